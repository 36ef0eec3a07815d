"""What the tests run, in one place: the tiny architectures they build, and the PEFT methods on them. The
README's support tables are generated from it.

- CORE_METHODS run on every architecture tests/ builds (conftest.ARCHITECTURES), unless PEFT_CANNOT says
  plain PEFT itself refuses the pair (test_exactness checks that it does).
- TUNERS has one or more configs for every PEFT tuner type (PeftType) that symbiosis runs exactly
  (`peft_support.EXACT`), each run on Llama, OPT and GPT-2 (Llama: Linear without biases; OPT: Linear with biases;
  GPT-2: transformers Conv1D) but where PEFT itself supports no Conv1D; and a config for every type and option
  symbiosis refuses (`peft_support.REFUSED`, `REFUSED_OPTIONS`), which test_peft_support checks is refused
  when `get_peft_model` runs, before anything is built.

`python tests/support_table.py --write` rewrites the README's tables from this; test_peft_support checks
that the README holds what it would write.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import peft
import torch
import transformers


VOCAB = 128

# name -> (config class, config kwargs, model class that saves the checkpoint, auto class a user loads with)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
              transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM),
    "gpt2": (transformers.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1),
             transformers.GPT2LMHeadModel, transformers.AutoModelForCausalLM),
    "gpt_bigcode": (transformers.GPTBigCodeConfig, dict(n_embd=64, n_layer=2, n_head=4, n_positions=128,
                    multi_query=True, bos_token_id=0, eos_token_id=1), transformers.GPTBigCodeForCausalLM, transformers.AutoModelForCausalLM),
    "gemma2": (transformers.Gemma2Config, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6),
               transformers.Gemma2ForCausalLM, transformers.AutoModelForCausalLM),
    "granite": (transformers.GraniteConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=2.0, logits_scaling=4.0,
                residual_multiplier=0.5, attention_multiplier=0.25),
                transformers.GraniteForCausalLM, transformers.AutoModelForCausalLM),
    "qwen2": (transformers.Qwen2Config, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2), transformers.Qwen2ForCausalLM,
              transformers.AutoModelForCausalLM),
    # Saved by transformers 5 with its head as `embed_out`, which transformers renames to `lm_head` on load.
    "gpt_neox": (transformers.GPTNeoXConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                 num_attention_heads=4, rotary_pct=0.5, tie_word_embeddings=False), transformers.GPTNeoXForCausalLM,
                 transformers.AutoModelForCausalLM),
    # Built for the engine's tests only (decoder architectures it must serve), not for the PEFT matrix.
    "mistral": (transformers.MistralConfig, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=None), transformers.MistralForCausalLM,
                transformers.AutoModelForCausalLM),
    "qwen3": (transformers.Qwen3Config, dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16), transformers.Qwen3ForCausalLM,
              transformers.AutoModelForCausalLM),
    # Mixtures of experts: transformers 5's fused experts (3-D parameters), a router that is not an nn.Linear.
    "mixtral": (transformers.MixtralConfig, dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                output_router_logits=True), transformers.MixtralForCausalLM, transformers.AutoModelForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(hidden_size=64, intermediate_size=112, moe_intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                  num_experts_per_tok=2, output_router_logits=True), transformers.Qwen3MoeForCausalLM,
                  transformers.AutoModelForCausalLM),
    "olmoe": (transformers.OlmoeConfig, dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              output_router_logits=True, eos_token_id=1, pad_token_id=0), transformers.OlmoeForCausalLM,
              transformers.AutoModelForCausalLM),
    "opt": (transformers.OPTConfig, dict(hidden_size=64, ffn_dim=112, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=64), transformers.OPTForCausalLM, transformers.AutoModelForCausalLM),
    "bert": (transformers.BertConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=112, num_labels=3), transformers.BertForSequenceClassification,
             transformers.AutoModelForSequenceClassification),
}


def make_checkpoint(arch: str, directory, dtype=torch.float32, seed: int = 0, **overrides):
    """Save a tiny random `arch` model (config + model.safetensors) into `directory`; returns its auto class."""
    config_cls, kwargs, model_cls, auto_class = ARCHITECTURES[arch]
    config = config_cls(vocab_size=VOCAB, max_position_embeddings=128, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # transformers starts biases at zero: code that mishandles them would pass unnoticed
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(directory)
    return auto_class


SEQ_CLS = {"bert"}
ATTENTION = {"gpt_neox": ["query_key_value"], "llama": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"],
             "granite": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "qwen3": ["q_proj", "v_proj"],
             "mistral": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"],
             "gpt2": ["c_attn"], "gpt_bigcode": ["c_attn"], "bert": ["query", "value"],
             **{arch: ["q_proj", "v_proj"] for arch in ("mixtral", "qwen3_moe", "olmoe")}}
FEEDFORWARD = {"gpt_neox": "dense_4h_to_h", "llama": "down_proj", "gemma2": "down_proj", "granite": "down_proj",
               "qwen2": "down_proj", "qwen3": "down_proj", "mistral": "down_proj", "opt": "fc2", "gpt2": "mlp.c_proj", "gpt_bigcode": "mlp.c_proj",
               "bert": "output.dense"}
NORMS = {"llama": ["input_layernorm", "post_attention_layernorm"], "opt": ["self_attn_layer_norm", "final_layer_norm"],
         "gpt2": ["ln_1", "ln_2"]}
ENGINE_ONLY = {"mistral", "qwen3"}
# The MoE models run the methods that fit a model without dense MLP layers, and LoRA on the router
# (tests/unit/client/test_experts.py); the loss they train includes the router's auxiliary loss. "all-linear" on
# them is LoRA on the fused experts and the router too (PEFT adds them by target_parameters).
MOE = ("mixtral", "qwen3_moe", "olmoe")
MOE_METHODS = ("lora", "rslora_all_linear", "dora", "adalora", "prompt", "ptuning", "loha", "lokr", "lora_router",
               "lora_experts")
MOE_NOT_RUN = {  # core method -> why the MoE models do not run it (the README's table says so)
    "dora_rslora_dropout_bias": "PEFT: n/a: PEFT's all-linear on a MoE model adds LoRA on the fused experts, whose "
                                "LoRA takes neither DoRA nor dropout",
    "lora_attn_mlp": "no dense MLP layer: the experts are fused parameters",
    "ia3": "no dense MLP layer: the experts are fused parameters",
    "prefix": "PEFT: n/a: transformers' router auxiliary loss fails on prefix tuning's virtual tokens, plain model too",
}
ARCHS = [arch for arch in ARCHITECTURES if arch not in ENGINE_ONLY and arch not in MOE]


def task(arch: str) -> str:
    return "SEQ_CLS" if arch in SEQ_CLS else "CAUSAL_LM"


def _core(arch: str, method: str):
    t, attn, ff = task(arch), ATTENTION[arch], FEEDFORWARD.get(arch)
    return {
        "lora": lambda: peft.LoraConfig(task_type=t, r=4, lora_alpha=8, target_modules=attn, init_lora_weights=False),
        "rslora_all_linear": lambda: peft.LoraConfig(task_type=t, r=4, lora_alpha=8, use_rslora=True,
                                                     target_modules="all-linear", init_lora_weights=False),
        "lora_attn_mlp": lambda: peft.LoraConfig(task_type=t, r=2, lora_alpha=4, target_modules=attn + [ff],
                                                 lora_dropout=0.1),
        "dora": lambda: peft.LoraConfig(task_type=t, r=4, lora_alpha=8, target_modules=attn, use_dora=True,
                                        init_lora_weights=False),
        "dora_rslora_dropout_bias": lambda: peft.LoraConfig(
            task_type=t, r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, use_rslora=True,
            lora_dropout=0.1, bias="all", init_lora_weights=False),
        "ia3": lambda: peft.IA3Config(task_type=t, target_modules=attn + [ff], feedforward_modules=[ff]),
        "adalora": lambda: peft.AdaLoraConfig(task_type=t, init_r=6, target_r=3, tinit=0, tfinal=0, deltaT=1,
                                              total_step=4, target_modules=attn),
        "prefix": lambda: peft.PrefixTuningConfig(task_type=t, num_virtual_tokens=4),
        "prompt": lambda: peft.PromptTuningConfig(task_type=t, num_virtual_tokens=4),
        "ptuning": lambda: peft.PromptEncoderConfig(task_type=t, num_virtual_tokens=4, encoder_hidden_size=32),
        "loha": lambda: peft.LoHaConfig(task_type=t, r=4, target_modules=attn, init_weights=False),
        # a MoE router's weight is a plain parameter (not an nn.Linear): PEFT reaches it by target_parameters
        "lora_router": lambda: peft.LoraConfig(task_type=t, r=4, lora_alpha=8, target_modules=attn,
                                               target_parameters=["mlp.gate.weight"], init_lora_weights=False),
        # and on the fused experts themselves
        "lora_experts": lambda: peft.LoraConfig(task_type=t, r=4, lora_alpha=8, target_modules=attn,
                                                target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                                                init_lora_weights=False),
        "lokr": lambda: peft.LoKrConfig(task_type=t, r=4, target_modules=attn, init_weights=False),
    }[method]()


# name -> how the README names it
CORE_METHODS = {
    "lora": "LoRA", "rslora_all_linear": "rsLoRA (all-linear)", "lora_attn_mlp": "LoRA attn+MLP, dropout",
    "dora": "DoRA", "dora_rslora_dropout_bias": "DoRA + rsLoRA, dropout, bias=all (all-linear)", "ia3": "IA3",
    "adalora": "AdaLoRA (with rank reallocation)", "prefix": "prefix", "prompt": "prompt", "ptuning": "P-tuning",
    "loha": "LoHa", "lokr": "LoKr",
}
MOE_ONLY_METHODS = {"lora_router": "LoRA on q and v, and on the router weight by target_parameters",
                    "lora_experts": "LoRA on q and v, and on the fused experts by target_parameters"}


def core_config(arch: str, method: str):
    return _core(arch, method)


def peft_config(method: str, arch: str):
    """A core method's config on an architecture (tests' usual spelling)."""
    return _core(arch, method)


# (arch, method) -> what plain PEFT says: the pair is not run, and test_exactness checks PEFT refuses it.
PEFT_CANNOT = {
    ("gpt2", "loha"): "PEFT's LoHa has no transformers Conv1D layer",
    ("gpt2", "lokr"): "PEFT's LoKr has no transformers Conv1D layer",
}
if "past_key_values" not in inspect.signature(transformers.BertModel.forward).parameters:  # newer transformers
    PEFT_CANNOT["bert", "prefix"] = (f"PEFT's prefix tuning passes `past_key_values`, which BERT-family models no "
                                     f"longer take in transformers {transformers.__version__}")


# --- every PEFT tuner type ---------------------------------------------------------------------------------


@dataclass
class Case:
    """One PEFT config on the tuner architectures. `make(arch, batch, tmp_path)` -> config."""

    make: Callable
    archs: tuple[str, ...] = ("llama", "opt", "gpt2")
    base_config: dict = field(default_factory=dict)  # set on the model's config before PEFT wraps it
    forward_kwargs: Callable[[dict], dict] = lambda batch: {}  # extra forward arguments, from the batch
    prepare: Callable | None = None  # applied to both PeftModels after they are built (same values)
    rtol: float = 1e-9
    note: str = ""


NO_CONV1D = ("llama", "opt")  # PEFT implements the method for nn.Linear, not transformers' Conv1D


def _targets(arch: str) -> list[str]:
    return ATTENTION[arch]


def _task_ids(batch: dict) -> dict:
    return {"task_ids": torch.arange(batch["input_ids"].shape[0]) % 2}


def _open_gates(model) -> None:
    """Adaption prompt's gates start at zero (the prompt then gets no gradient): open them."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "adaption_gate" in name:
                parameter.fill_(0.5)


def _xlora(arch, batch, tmp_path):
    """Two saved LoRA adapters (plain PEFT files) that X-LoRA mixes."""
    config_cls, kwargs, model_cls, _ = ARCHITECTURES[arch]
    adapters = {}
    for i in range(2):
        directory = tmp_path / f"xlora-expert-{arch}-{i}"
        if not (directory / "adapter_config.json").is_file():
            with torch.random.fork_rng():  # both sides' X-LoRA classifiers must start from the same random state
                torch.manual_seed(100 + i)
                model = model_cls(config_cls(vocab_size=128, max_position_embeddings=128, **kwargs)).to(torch.float64)
                peft.get_peft_model(model, peft.LoraConfig(target_modules=_targets(arch), r=4,
                                                           init_lora_weights=False)).save_pretrained(directory)
        adapters[str(i)] = str(directory)
    return peft.XLoraConfig(task_type="CAUSAL_LM", hidden_size=64, adapters=adapters, xlora_depth=1, xlora_size=16,
                            xlora_dropout_p=0.0)


def _lora(**options):
    return lambda arch, batch, tmp: peft.LoraConfig(target_modules=_targets(arch), r=4, init_lora_weights=False,
                                                    **options)


def _ids_of(batch: dict, row: int, start: int, stop: int) -> list[int]:
    return batch["input_ids"][row, start:stop].tolist()


TUNERS: dict[str, dict[str, Case]] = {
    "PROMPT_TUNING": {"prompt": Case(lambda a, b, t: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                             num_virtual_tokens=4))},
    "MULTITASK_PROMPT_TUNING": {"multitask": Case(
        lambda a, b, t: peft.MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_tasks=2,
                                                          num_ranks=2), forward_kwargs=_task_ids)},
    "P_TUNING": {"ptuning": Case(lambda a, b, t: peft.PromptEncoderConfig(task_type="CAUSAL_LM",
                                                                          num_virtual_tokens=4,
                                                                          encoder_hidden_size=16))},
    "PREFIX_TUNING": {"prefix_projection": Case(lambda a, b, t: peft.PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4, prefix_projection=True, encoder_hidden_size=16))},
    "CARTRIDGE": {"cartridge": Case(lambda a, b, t: peft.CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                                         num_frozen_tokens=1))},
    "CPT": {"cpt": Case(lambda a, b, t: peft.CPTConfig(task_type="CAUSAL_LM", cpt_token_ids=[5, 6, 7, 8],
                                                       cpt_mask=[1, 1, 1, 1], cpt_tokens_type_mask=[1, 2, 3, 4]))},
    "ADAPTION_PROMPT": {"adaption_prompt": Case(
        lambda a, b, t: peft.AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=4, adapter_layers=2),
        archs=("llama", "gpt2"), prepare=_open_gates, note="PEFT adapts Llama-, Mistral- and GPT-2-style attention")},
    "LORA": {
        "lora_bias": Case(_lora(lora_bias=True)),
        "bias_all": Case(lambda a, b, t: peft.LoraConfig(target_modules=_targets(a), r=4, init_lora_weights=False,
                                                         bias="all")),
        "gaussian_init": Case(lambda a, b, t: peft.LoraConfig(target_modules=_targets(a), r=4,
                                                              init_lora_weights="gaussian")),
        "orthogonal_init": Case(lambda a, b, t: peft.LoraConfig(target_modules=_targets(a), r=4,
                                                                init_lora_weights="orthogonal")),
        "alora": Case(lambda a, b, t: peft.LoraConfig(task_type="CAUSAL_LM", target_modules=_targets(a), r=4,
                                                      init_lora_weights=False,
                                                      alora_invocation_tokens=_ids_of(b, 1, 4, 6))),
        "velora": Case(_lora(velora_config=peft.VeloraConfig(num_groups=8))),
        "bdlora": Case(lambda a, b, t: peft.LoraConfig(
            target_modules=_targets(a), r=4, init_lora_weights=False,
            use_bdlora=peft.BdLoraConfig(target_modules_bd_a=_targets(a)[:1], target_modules_bd_b=_targets(a)[1:],
                                         nblocks=2, match_strict=False)), archs=NO_CONV1D),
        "monteclora": Case(_lora(monteclora_config=peft.MontecloraConfig(num_samples=2))),
    },
    "ADALORA": {"adalora": Case(lambda a, b, t: peft.AdaLoraConfig(target_modules=_targets(a), init_r=4, target_r=2,
                                                                   total_step=10, init_lora_weights=False))},
    "IA3": {"ia3": Case(lambda a, b, t: peft.IA3Config(target_modules=_targets(a) + [FEEDFORWARD[a]],
                                                       feedforward_modules=[FEEDFORWARD[a]], init_ia3_weights=False))},
    "BOFT": {"boft": Case(lambda a, b, t: peft.BOFTConfig(target_modules=_targets(a), boft_block_size=8,
                                                          boft_n_butterfly_factor=2, init_weights=False),
                          archs=NO_CONV1D)},
    "BEFT": {"beft": Case(lambda a, b, t: peft.BeftConfig(target_modules=_targets(a), init_weights=False),
                          archs=NO_CONV1D)},
    "LILY": {"lily": Case(lambda a, b, t: peft.LilyConfig(target_modules=_targets(a), r=4, init_weights=False),
                          archs=NO_CONV1D)},
    "LOHA": {"loha": Case(lambda a, b, t: peft.LoHaConfig(target_modules=_targets(a), r=4, init_weights=False),
                          archs=NO_CONV1D)},
    "LOKR": {"lokr": Case(lambda a, b, t: peft.LoKrConfig(target_modules=_targets(a), r=4, init_weights=False),
                          archs=NO_CONV1D)},
    "OFT": {"oft": Case(lambda a, b, t: peft.OFTConfig(target_modules=_targets(a), r=0, oft_block_size=8,
                                                       init_weights=False), archs=NO_CONV1D)},
    "POLY": {"poly": Case(lambda a, b, t: peft.PolyConfig(task_type="CAUSAL_LM", target_modules=_targets(a), r=4,
                                                          n_tasks=2, n_skills=2, init_weights=False),
                          archs=NO_CONV1D, forward_kwargs=_task_ids)},
    "LN_TUNING": {"ln_tuning": Case(lambda a, b, t: peft.LNTuningConfig(target_modules=NORMS[a]))},
    "VERA": {"vera": Case(lambda a, b, t: peft.VeraConfig(target_modules=_targets(a), r=8, init_weights=False))},
    "PVERA": {"pvera": Case(lambda a, b, t: peft.PveraConfig(target_modules=_targets(a), r=8, init_weights=False))},
    "FOURIERFT": {"fourierft": Case(lambda a, b, t: peft.FourierFTConfig(target_modules=_targets(a), n_frequency=64,
                                                                         init_weights=False))},
    "XLORA": {"xlora": Case(_xlora, archs=NO_CONV1D, base_config={"use_cache": False},
                            note="PEFT's X-LoRA fails to load its experts on GPT-2 (a key-prefix assumption)")},
    "HRA": {"hra": Case(lambda a, b, t: peft.HRAConfig(target_modules=_targets(a), r=4, init_weights=False),
                        archs=NO_CONV1D),
            "hra_gram_schmidt": Case(lambda a, b, t: peft.HRAConfig(target_modules=_targets(a), r=4,
                                                                    init_weights=False, apply_GS=True),
                                     archs=NO_CONV1D)},
    "VBLORA": {"vblora": Case(lambda a, b, t: peft.VBLoRAConfig(target_modules=_targets(a), r=4, num_vectors=16,
                                                                vector_length=16, topk=2))},
    "UNILORA": {"unilora": Case(lambda a, b, t: peft.UniLoraConfig(target_modules=_targets(a), r=4,
                                                                   theta_d_length=64, init_weights=False))},
    "MISS": {"miss": Case(lambda a, b, t: peft.MissConfig(target_modules=_targets(a), r=8, init_weights=False),
                          archs=NO_CONV1D),
             "miss_mini": Case(lambda a, b, t: peft.MissConfig(target_modules=_targets(a), r=8, mini_r=4,
                                                               init_weights="mini"), archs=NO_CONV1D)},
    "RANDLORA": {"randlora": Case(lambda a, b, t: peft.RandLoraConfig(target_modules=_targets(a), r=8,
                                                                      init_weights=False))},
    "ROAD": {"road": Case(lambda a, b, t: peft.RoadConfig(target_modules=_targets(a), group_size=16,
                                                          init_weights=False), archs=NO_CONV1D)},
    "TRAINABLE_TOKENS": {"trainable_tokens": Case(lambda a, b, t: peft.TrainableTokensConfig(
        token_indices=_ids_of(b, 1, 0, 3), init_weights=False))},
    "SHIRA": {"shira": Case(lambda a, b, t: peft.ShiraConfig(target_modules=_targets(a), r=2, init_weights=False),
                            archs=NO_CONV1D)},
    "C3A": {"c3a": Case(lambda a, b, t: peft.C3AConfig(target_modules=_targets(a), block_size=16,
                                                       init_weights="gaussian"), archs=NO_CONV1D)},
    "WAVEFT": {"waveft": Case(lambda a, b, t: peft.WaveFTConfig(target_modules=_targets(a), n_frequency=64,
                                                                init_weights=False))},
    "GRALORA": {"gralora": Case(lambda a, b, t: peft.GraloraConfig(target_modules=_targets(a), r=4, gralora_k=2,
                                                                   alpha=8, init_weights=False))},
    "PEANUT": {"peanut": Case(lambda a, b, t: peft.PeanutConfig(target_modules=_targets(a), r=4, depth=1,
                                                                init_weights=False), archs=NO_CONV1D)},
    "SHADOW": {"shadow": Case(lambda a, b, t: peft.ShadowConfig(task_type="CAUSAL_LM", r=4, shadow_dropout=0.0,
                                                                init_weights=False), archs=("llama", "gpt2"))},
    "DEFT": {"deft_random": Case(lambda a, b, t: peft.DeftConfig(target_modules=_targets(a), r=4,
                                                                 init_weights=False)),
             "deft_para": Case(lambda a, b, t: peft.DeftConfig(target_modules=_targets(a), r=4, para=True))},
}

# A config for every refused type and option (PEFT type, fields besides target_modules): refused on a split model.
REFUSED_CASES: dict[str, tuple[str, dict]] = {
    "ADAMSS": ("ADAMSS", dict(r=8, num_subspaces=2, subspace_rank=2)),
    "OSF": ("OSF", dict(effective_rank=8)),
    "PSOFT": ("PSOFT", dict(r=4)),
    "TINYLORA": ("TINYLORA", dict(r=2, u=4)),
    "FROD": ("FROD", dict(progressbar=False)),
    "DELORA": ("DELORA", dict(r=4)),
    "SUPERTUNING": ("SUPERTUNING", dict(sparsity=0.9)),
    "HIRA": ("HIRA", dict(r=4)),
    "GLORA": ("GLORA", dict(r=4)),
    "LoRA init_lora_weights='pissa' / 'pissa_niter_k'": ("LORA", dict(r=4, init_lora_weights="pissa_niter_2")),
    "LoRA init_lora_weights='olora'": ("LORA", dict(r=4, init_lora_weights="olora")),
    "LoRA init_lora_weights='corda'": ("LORA", dict(r=4, init_lora_weights="corda")),
    "LoRA init_lora_weights='loftq'": ("LORA", dict(r=4, init_lora_weights="loftq",  # a config PEFT accepts where
                                                    loftq_config={"loftq_bits": 4, "loftq_iter": 1})),  # scipy is
    "LoRA init_lora_weights='lora_ga'": ("LORA", dict(r=4, init_lora_weights="lora_ga")),
    "LoRA init_lora_weights='mica'": ("LORA", dict(r=4, init_lora_weights="mica")),
    "LoRA kasa_config (KaSA)": ("LORA", dict(r=4, kasa_config=peft.KasaConfig())),
    "LoRA target_parameters on a linear layer's base weight": (
        "LORA", dict(r=4, target_modules=None, target_parameters=["q_proj.weight"])),
    "MiSS init_weights='bat'": ("MISS", dict(r=8, init_weights="bat")),
    "DEFT init_weights=True without para (its default)": ("DEFT", dict(r=4)),
}
