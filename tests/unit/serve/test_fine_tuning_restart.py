"""`symbiosis serve` killed (SIGKILL) while a fine-tuning job trains, then started again: the job resumes from its
last checkpoint and ends with the adapter that the same job (same seed) ends with when nothing stops it."""

from __future__ import annotations

import io
import json
import signal
import time

import openai
import torch
from safetensors.torch import load_file

from conftest import KEYS, launch, terminate, wait_for_job

LINES = [{"prompt": f"example {i}", "completion": f" the cat sat on mat {i}"} for i in range(6)]
HYPER = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 4, "batch_size": 2,
                                                                  "learning_rate_multiplier": 10}}}




def test_a_killed_service_resumes_its_jobs_from_their_last_checkpoint(served_files, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alice {KEYS['alice']}\n")
    state = tmp_path / "state"
    options = ("--served-model-name", "tiny", "--checkpoint-every", "2", "--max-running-jobs", "1")
    process, url = launch(served_files["model"], state, keys, *options)
    port = int(url.rsplit(":", 1)[1])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], max_retries=5)
        data = io.BytesIO("\n".join(json.dumps(line) for line in LINES).encode())
        data.name = "train.jsonl"
        file_id = client.files.create(file=data, purpose="fine-tune").id
        peft_lora = {"peft": {"method": "lora", "config": {"r": 4, "lora_alpha": 8}}}
        first = client.fine_tuning.jobs.create(model="tiny", training_file=file_id, seed=5, method=HYPER,
                                               extra_body=peft_lora)
        deadline = time.monotonic() + 120
        while not [c for c in client.fine_tuning.jobs.checkpoints.list(first.id).data if c.step_number >= 4]:
            assert time.monotonic() < deadline, "no checkpoint came"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait(30)

        process, _ = launch(served_files["model"], state, keys, *options, port=port)
        resumed = wait_for_job(client, first.id, ("succeeded", "failed"))
        assert resumed.status == "succeeded", resumed.error
        messages = [e.message for e in client.fine_tuning.jobs.list_events(first.id, limit=100)]
        assert any(m.startswith("Resumed from the checkpoint at step") for m in messages)
        again = client.fine_tuning.jobs.create(model="tiny", training_file=file_id, seed=5, method=HYPER,
                                               extra_body=peft_lora)
        assert wait_for_job(client, again.id, ("succeeded", "failed")).status == "succeeded"
        final = [state / "jobs" / job_id / "checkpoints" / "step-12" / "adapter_model.safetensors"
                 for job_id in (first.id, again.id)]
        killed, whole = (load_file(path) for path in final)
        for name, tensor in whole.items():
            torch.testing.assert_close(killed[name], tensor, rtol=1e-6, atol=1e-8)
    finally:
        terminate(process)
