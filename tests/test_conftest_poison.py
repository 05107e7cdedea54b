"""The CUDA modules' memory poisoning follows the allocator: on with its cache, off without it."""
from conftest import poison_wanted


def test_poisoning_needs_the_caching_allocator():
    assert poison_wanted({})
    assert poison_wanted({"PYTORCH_NO_CUDA_MEMORY_CACHING": "0"})
    assert not poison_wanted({"DSV4_TEST_POISON": "0"})
    # compute-sanitizer runs: no cache to hold the poison, and its read-back would be reported
    assert not poison_wanted({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
