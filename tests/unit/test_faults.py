"""collab.faults: the test-only fault spec and its one-shot triggers."""

import pytest

from collab.faults import parse_faults


def test_spec_is_parsed_and_each_fault_fires_once():
    faults = parse_faults("nan_loss@3, nan_parameters@5,drift_parameters@4,pause_checkpoint_write@2=2.5")
    assert faults.at_epoch == {"nan_loss": 3, "nan_parameters": 5, "drift_parameters": 4}
    assert (faults.pause_write_number, faults.pause_seconds) == (2, 2.5)
    assert [faults.fire("nan_loss", epoch) for epoch in (1, 2, 3, 4)] == [False, False, True, False]
    assert not faults.fire("nan_parameters", 4) and faults.fire("nan_parameters", 9)
    assert not faults.fire("something_else", 100)


def test_empty_spec_is_inactive():
    faults = parse_faults("")
    assert (faults.at_epoch, faults.pause_write_number) == ({}, 0)


@pytest.mark.parametrize(
    "spec", ["nan_loss@x", "explode@3", "pause_checkpoint_write@2=soon", "pause_checkpoint_write=5", "nan_loss"]
)
def test_malformed_spec_names_the_item(spec):
    with pytest.raises(ValueError, match="COLLAB_TEST_FAULTS: cannot read"):
        parse_faults(spec)
