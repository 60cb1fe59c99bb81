"""How ranks, tags and chunks may be given, on every engine (checks in checks_ranks.py)."""
from tests.conformance import checks_ranks


def test_integer_like_ranks_and_tags(runner):
    runner.run(checks_ranks.check_integer_like_ranks_and_tags)


def test_strided_chunks_arrive_contiguous(runner):
    # Before, in-memory ranks received scatter and all_to_all chunks with the sender's strides.
    runner.run(checks_ranks.check_strided_chunks_arrive_contiguous)
