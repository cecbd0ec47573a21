"""bench/vocab_coverage.py: the share of a text's tokens inside a draft vocabulary, and which ones miss."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vocab_coverage", ROOT / "bench" / "vocab_coverage.py")
vc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vc)


def test_coverage_counts_tokens_outside_the_vocabulary():
    n, cov, missed = vc.coverage([1, 2, 3, 3, 9, 9, 9, 4], {1, 2, 4})
    assert n == 8 and cov == 3 / 8
    assert missed.most_common() == [(9, 3), (3, 2)]
    assert vc.coverage([], {1})[:2] == (0, 1.0)
