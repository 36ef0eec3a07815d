"""Every PEFT tuner type: exact on a split model (float64, against plain PEFT) or refused when get_peft_model runs,
with the reason; an untested one is allowed with a warning (tests/matrix.py holds the configs)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import peft
import pytest
import torch
from peft import get_peft_model
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils.peft_types import PeftType

import matrix
import symbiosis
from symbiosis.client import peft_support
from symbiosis.client.virtual import VirtualConv1D, VirtualLinear
from helpers import assert_trains_as_plain_peft, batch, build_pair

CASES = [(kind, name, arch) for kind, cases in matrix.TUNERS.items() for name, case in cases.items()
         for arch in case.archs]


@pytest.mark.parametrize("kind,name,arch", CASES)
def test_tuner_type_is_exact(kind, name, arch, checkpoints, executors, tmp_path_factory):
    case = matrix.TUNERS[kind][name]
    tmp = tmp_path_factory.getbasetemp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "untested" warning for a type the matrix runs
        warnings.filterwarnings("ignore", message="(?!PEFT method)")  # PEFT's own warnings are PEFT's business
        reference, split = build_pair(arch, name, checkpoints, executors, make_config=lambda: case.make(
            arch, batch(arch), tmp), prepare=case.prepare, base_config=case.base_config)
    assert_trains_as_plain_peft(reference, split, arch, case.forward_kwargs, case.rtol)


@pytest.mark.parametrize("kind,name", [(k, n) for k, cases in matrix.TUNERS.items() for n, case in cases.items()
                                       if "gpt2" not in case.archs])
def test_plain_peft_itself_lacks_the_conv1d_layers_the_matrix_leaves_out(kind, name, checkpoints, tmp_path):
    path, auto_class = checkpoints("gpt2")
    with pytest.raises((ValueError, TypeError, NotImplementedError, AttributeError, KeyError)):
        model = get_peft_model(auto_class.from_pretrained(path, dtype=torch.float64),
                               matrix.TUNERS[kind][name].make("gpt2", batch("gpt2"), tmp_path))
        model(**batch("gpt2"))


@pytest.mark.parametrize("refused", sorted(matrix.REFUSED_CASES))
def test_refused_before_anything_is_built(refused, checkpoints, executors):
    kind, fields = matrix.REFUSED_CASES[refused]
    fields = {"target_modules": ["q_proj", "v_proj"], **fields}
    try:
        config = PEFT_TYPE_TO_CONFIG_MAPPING[PeftType[kind]](**fields)
    except ImportError:  # PEFT builds some configs only with scikit-learn or scipy installed: check the config alone
        config = SimpleNamespace(peft_type=PeftType[kind], **fields)
        with pytest.raises(symbiosis.UnsupportedAdapter, match="cannot run on a split model"):
            peft_support.check_config(config)
        return
    path, auto_class = checkpoints("llama")
    split = symbiosis.from_pretrained(path, executors("llama"), auto_class=auto_class, dtype=torch.float64)
    before = {name: type(module) for name, module in split.named_modules()}
    with pytest.raises(symbiosis.UnsupportedAdapter, match="cannot run on a split model") as refusal:
        get_peft_model(split, config)
    assert refused.split(" ")[0] in str(refusal.value)  # the error names the method
    assert {name: type(module) for name, module in split.named_modules()} == before  # nothing was injected


def test_the_tables_cover_every_tuner_type_of_peft():
    """EXACT is what the matrix runs; REFUSED and REFUSED_OPTIONS are what it refuses; nothing is both."""
    assert peft_support.EXACT == set(matrix.TUNERS)
    assert set(peft_support.REFUSED) | {o.setting for o in peft_support.REFUSED_OPTIONS} == set(matrix.REFUSED_CASES)
    assert not peft_support.EXACT & set(peft_support.REFUSED)
    assert set(peft_support.EXACT) | set(peft_support.REFUSED) <= {t.value for t in PeftType}


def test_an_untested_tuner_type_is_allowed_with_a_warning(checkpoints, executors, monkeypatch):
    """A type a later PEFT release adds is in neither table: it runs, and says it is untested."""
    monkeypatch.setattr(peft_support, "EXACT", peft_support.EXACT - {"VERA"})
    path, auto_class = checkpoints("llama")
    split = symbiosis.from_pretrained(path, executors("llama"), auto_class=auto_class, dtype=torch.float64)
    with pytest.warns(UserWarning, match="VERA is not tested on split models"):
        get_peft_model(split, peft.VeraConfig(target_modules=["q_proj"], r=4))


def test_rewritten_layers_keep_peft_state_and_refuse_merging(checkpoints, executors, tmp_path):
    """A rewritten layer is PEFT's class with its forward replaced: same state dict keys, saved files load in plain
    PEFT; merging needs W and raises VirtualWeightAccess."""
    path, auto_class = checkpoints("llama")
    split = symbiosis.from_pretrained(path, executors("llama"), auto_class=auto_class, dtype=torch.float64)
    tuned = get_peft_model(split, peft.HRAConfig(target_modules=["q_proj"], r=4, init_weights=False))
    layer = tuned.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "SplitHRALinear" and isinstance(layer, peft.tuners.hra.layer.HRALinear)
    assert isinstance(layer.get_base_layer(), (VirtualLinear, VirtualConv1D))
    with pytest.raises(symbiosis.VirtualWeightAccess):
        tuned.merge_and_unload()


def test_readme_tables_are_generated_from_this_matrix():
    import support_table

    readme = support_table.README.read_text()
    other = support_table.generated_with(readme)
    if other is not None:  # a newer PEFT may add tuner types: they show as untested once regenerated
        pytest.skip(f"README.md's tables say '{other}', installed: {support_table.versions()}")
    assert support_table.readme_with_tables(readme) == readme, \
        "README.md's support tables are not what the tests run: `python tests/support_table.py --write`"
