"""dsv4/kernels/common.py's host-side helpers on the CPU: the arrival counters of the kernels whose
last program finishes a row (`row_counters`)."""
import torch

from dsv4.kernels import common


def test_row_counters_kept_zeroed_and_apart():
    dev = torch.device("cpu")
    a = common.row_counters(dev, 3, "test-a")
    assert a.dtype == torch.int32 and a.shape == (3,) and not a.any()
    # the same owner gets the same memory (a captured graph holds its address)
    assert common.row_counters(dev, 2, "test-a").data_ptr() == a.data_ptr()
    # another owner gets its own set
    assert common.row_counters(dev, 3, "test-b").data_ptr() != a.data_ptr()
    # more rows than the set holds: a new zeroed set; the old one is kept alive
    n = common.COUNTERS_MIN + 1
    big = common.row_counters(dev, n, "test-a")
    assert big.shape == (n,) and not big.any() and big.data_ptr() != a.data_ptr()
    assert any(r.data_ptr() == a.data_ptr() for r in common._RETIRED)
    assert common.row_counters(dev, 3, "test-a").data_ptr() == big.data_ptr()
