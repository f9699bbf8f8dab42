"""The cost model (lab/speed.py) reads a run's correction: TR-DPO's soft updates move the reference."""
from __future__ import annotations

from humanline_cli.core.humanline import HumanlineSpec


def test_the_cost_model_counts_trdpo_mixes_and_leaves_its_reference_uncached():
    """lab/speed.py reads a run's flat config: correction=trdpo with tau 4 over 10 steps mixes the reference
    twice (after steps 4 and 8), so the reference moves and its log-probs are never cached."""
    from humanline_cli.core.reference import reference_moves
    from humanline_cli.lab.speed import correction_spec, reference_syncs

    c = correction_spec({"correction.kind": "trdpo", "correction.tau": 4})
    assert (c.kind, c.alpha, c.tau) == ("trdpo", 0.6, 4)
    assert reference_syncs(HumanlineSpec(), "offline", 10, 0, c) == 2 and reference_moves(HumanlineSpec(), "offline", c)
    assert correction_spec({}).kind == "none" and reference_syncs(HumanlineSpec(), "offline", 10, 0) == 0
