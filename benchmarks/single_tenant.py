"""Single-tenant overhead (paper Table 2): one LoRA fine-tuning job, plain PEFT vs symbiosis with the client
in-process and in a separate process on the same GPU (ipc://, CUDA IPC buffer).

    python benchmarks/single_tenant.py --models llama-3.2-1b,llama-2-13b
"""

from __future__ import annotations

import argparse
import gc

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import symbiosis
from common import LORAS, checkpoint, device, dtype, emit, lora, peak_gib, reset_peak, start_executor, time_training


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="llama-3.2-1b")
    parser.add_argument("--loras", default=",".join(LORAS))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    tokens = args.batch_size * args.seq_len
    common = dict(bench="single_tenant", batch_size=args.batch_size, seq_len=args.seq_len, device=device())

    def measure(model_name, lora_name, mode, model, baseline=None):
        seconds = time_training(model, args.batch_size, args.seq_len, iters=args.iters)
        record = dict(common, model=model_name, lora=lora_name, mode=mode, s_per_iter=round(seconds, 5),
                      tokens_per_s=round(tokens / seconds, 1), peak_gib_this_process=round(peak_gib(), 2))
        if baseline:
            record["vs_plain_peft"] = round(seconds / baseline, 3)
        emit(**record)
        return seconds

    for model_name in args.models.split(","):
        path = checkpoint(model_name)
        plain = {}
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype(), device_map=device())
        for lora_name in args.loras.split(","):
            reset_peak()
            peft_model = get_peft_model(base, lora(lora_name))
            plain[lora_name] = measure(model_name, lora_name, "plain_peft", peft_model)
            base = peft_model.unload()
        del base, peft_model
        gc.collect()

        reset_peak()
        executor = symbiosis.Executor.from_pretrained(path, device=device(), dtype=dtype())
        for lora_name in args.loras.split(","):
            client = get_peft_model(symbiosis.from_pretrained(path, executor, device=device()), lora(lora_name))
            measure(model_name, lora_name, "symbiosis_in_process", client, plain[lora_name])
            client.get_base_model().symbiosis_session.close()
            del client
        executor.close()
        del executor
        gc.collect()

        reset_peak()
        url = "ipc:///tmp/symbiosis-bench.sock"
        process = start_executor(path, url)
        try:
            remote = symbiosis.connect(url, timeout=120)
            for lora_name in args.loras.split(","):
                client = get_peft_model(symbiosis.from_pretrained(path, remote, device=device()), lora(lora_name))
                measure(model_name, lora_name, "symbiosis_separate_process", client, plain[lora_name])
                client.get_base_model().symbiosis_session.close()
                del client
            emit(bench="executor_stats", model=model_name, **remote.stats()["overall"])
        finally:
            process.terminate()
            process.wait()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
