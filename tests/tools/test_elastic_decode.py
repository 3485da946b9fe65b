"""`ubep decode --kill-host`: the elastic test bed's timeline. Two emulated hosts hold every expert
each, so when one dies the other serves every token: the survivors' greedy tokens must stay those of
the model run whole, without EP (an independent reference), while the timeline shows the mask."""

from __future__ import annotations

import pytest

from ubep.cli import main

SMALL = ["--steps", "4", "--repeats", "1", "--batch", "2", "--hidden", "64", "--experts", "4", "--topk", "2"]


@pytest.mark.timeout(300)
def test_a_host_killed_mid_decode_is_masked_and_the_survivors_tokens_stay_exact(tmp_path, capsys):
    out_png = tmp_path / "elastic.png"
    assert (
        main(["decode", "--hosts", "2", "--kill-host", "1", "--at-step", "2", *SMALL, "--plot", str(out_png)])
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed if line[:4].strip().isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"], printed
    assert [r[2] for r in rows] == ["-", "-", "2,3", "2,3"], printed  # masked from the step it died in
    assert all(r[3] == "0" and r[5] == "yes" for r in rows), printed  # nothing left out, tokens exact
    assert int(rows[2][4]) > 0, printed  # entries whose expert lost a copy, served by the live one
    assert "death to the end of its step" in printed[-1] and out_png.stat().st_size > 0


def test_rejoin_says_it_is_not_supported_yet():
    with pytest.raises(SystemExit, match="--rejoin-at-step: not supported yet"):
        main(["decode", "--kill-host", "1", "--rejoin-at-step", "5"])
