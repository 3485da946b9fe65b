"""The docs say what the code and the repository hold: figures and their sources."""

from __future__ import annotations

import os

from ubep.sim import ablation, calibrate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_figure_the_simulator_compares_against_is_in_the_repository_with_its_source():
    figures = _flat(_read("docs", "paper_figures.md"))
    published = [
        *ablation.PAPER_SCHEDULING_US.values(),
        *ablation.PAPER_SYNC_RANGE,
        *ablation.PAPER_HEADLINE.values(),
        ablation.PAPER_EP128_MEAN_8_64,
        *calibrate.TRTLLM_NVL72_EP8_US,
    ]
    for value in published:
        assert f"{value:.1f}" in figures, value
    eps = sorted(calibrate.DEEPEP_LL_US)
    assert f"| EP | {' | '.join(map(str, eps))} |" in figures
    for half, name in enumerate(("dispatch", "combine")):
        values = " | ".join(f"{calibrate.DEEPEP_LL_US[ep][half]:g}" for ep in eps)
        assert f"| {name} (us) | {values} |" in figures
    for source in ("arXiv 2607.06202", "arXiv 2506.12708", "deepseek-ai/DeepEP", "TensorRT-LLM"):
        assert source in figures
    cited = []
    for folder in ("src", "docs"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            cited += [f for f in files if f.endswith((".py", ".md")) and "PAPER.md" in _read(base, f)]
    assert cited == []  # the paper's figures live in docs/paper_figures.md, not in a file we lack
