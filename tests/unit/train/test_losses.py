"""The losses' inputs and configs (train/losses.py): a config that would make a loss NaN or meaningless is refused."""

from __future__ import annotations

import math

import pytest
import torch

from symbiosis.errors import BadCall
from symbiosis.train.losses import check


def _inputs():
    return {"target_tokens": torch.tensor([1, 2, 3]), "logprobs": torch.zeros(3, dtype=torch.float64),
            "advantages": torch.ones(3, dtype=torch.float64)}


@pytest.mark.parametrize("config, message", [({"clip_low_threshold": math.nan}, "must be finite"),
                                             ({"clip_high_threshold": math.inf}, "must be finite"),
                                             ({"clip_low_threshold": "x"}, "must be a number"),
                                             ({"clip_low_threshold": 5.0, "clip_high_threshold": 0.1}, "is above")])
def test_a_ppo_config_that_makes_no_loss_is_refused(config, message):
    with pytest.raises(BadCall, match=message):
        check("ppo", 3, _inputs(), config)
    assert check("ppo", 3, _inputs(), {"clip_low_threshold": 0.5}) == {"clip_low_threshold": 0.5,
                                                                              "clip_high_threshold": 1.2}
