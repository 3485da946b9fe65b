"""Observability: the stats a Buffer records against the reference, the straggler report against
a delay injected on purpose, the exporters' formats against their own parsers, and the
environment settings with their provenance.

The traffic matrix and expert load are computed independently from every rank's inputs by
`ubep.reference` (who receives which rows) and a bincount of the routing.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
import torch.distributed as dist
from scenarios import Scenario

import ubep
from ubep import observe, reference, settings
from ubep.faults import FaultPlan
from ubep.stats import Stats, StatsOptions
from ubep.transport.virtual import VirtualWorld

SC = Scenario(name="observe", num_ranks=3, num_experts=12, topk=3, hidden=40, seed=21)


def expected_dispatch_rows(sc: Scenario) -> torch.Tensor:
    """int64 [R, R]: rows source s (row) sends to destination d in a normal dispatch, by the reference."""
    xs, idxs, ws, ref = sc.expected()
    R = sc.num_ranks
    return torch.tensor([[int((ref[d].src_rank_M == s).sum()) for d in range(R)] for s in range(R)])


def expected_pairs(sc: Scenario) -> torch.Tensor:
    """int64 [R, R]: (token, expert) pairs of source s whose expert lives on d (low-latency rows)."""
    _, idxs, _ = sc.inputs()
    R, L = sc.num_ranks, sc.num_experts // sc.num_ranks
    out = torch.zeros(R, R, dtype=torch.int64)
    for s, idx in enumerate(idxs):
        owners = reference.owner_of(idx[idx >= 0], sc.num_experts, R)
        out[s] = torch.bincount(owners, minlength=R)
    assert L * R == sc.num_experts
    return out


def expected_load(sc: Scenario) -> torch.Tensor:
    _, idxs, _ = sc.inputs()
    every = torch.cat([idx.flatten() for idx in idxs])
    return torch.bincount(every[every >= 0], minlength=sc.num_experts)


def _normal_calls(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    xs, idxs, ws = sc.inputs()
    got = buf.dispatch(xs[me], topk_idx=idxs[me], topk_weights=ws[me])
    buf.combine(got.recv_x, got.handle, topk_weights=got.recv_topk_weights)


def _ll_calls(buf: ubep.Buffer, sc: Scenario, me: int) -> None:
    xs, idxs, ws = sc.inputs()
    got = buf.low_latency_dispatch(xs[me], idxs[me], sc.capacity, sc.num_experts)
    buf.low_latency_combine(got.recv_x, idxs[me], ws[me], got.handle)


def _recorded(group, sc: Scenario, mode: str, **kw) -> Stats:
    me = group.rank if hasattr(group, "rank") else dist.get_rank()
    with ubep.Buffer(
        group, hidden=sc.hidden, num_experts=sc.num_experts, max_tokens_per_rank=sc.capacity, stats=True,
        low_latency=mode == "ll", **kw,
    ) as buf:  # fmt: skip
        (_ll_calls if mode == "ll" else _normal_calls)(buf, sc, me)
        return buf.stats(merge=True)


def _check_against_reference(stats: Stats, sc: Scenario, mode: str) -> None:
    if mode == "ll":
        sent_RR = expected_pairs(sc)
    else:
        sent_RR = expected_dispatch_rows(sc)
    assert stats.merged
    assert torch.equal(stats.traffic_rows_RR, sent_RR + sent_RR.T)  # out in dispatch, back in combine
    assert torch.equal(stats.expert_load_E, expected_load(sc))
    if mode == "normal":
        row, K = sc.hidden * 2, sc.topk  # bf16 values; top-k ids and weights out, weights back
        want = sent_RR * (row + K * 12) + sent_RR.T * (row + K * 4)
        assert torch.equal(stats.traffic_bytes_RR, want)
    assert stats.calls == (
        {"ll_dispatch": 1, "ll_combine": 1} if mode == "ll" else {"dispatch": 1, "combine": 1}
    )


@pytest.mark.parametrize("mode", ["normal", "ll"])
@pytest.mark.parametrize("protocol", ["ubep", "bsp"])
@pytest.mark.parametrize("engine", ["numba", "torch"])
def test_traffic_and_load_match_reference_on_a_heap(mode, protocol, engine):
    if engine == "numba":
        pytest.importorskip("numba")
    if mode == "ll" and protocol == "bsp":
        pytest.skip("low-latency mode has one protocol on a heap")
    got = VirtualWorld(SC.num_ranks, timeout_s=120).run(
        lambda rank: _recorded(rank, SC, mode, protocol=protocol, engine=engine)
    )
    for stats in got:  # every rank holds the same merged snapshot
        _check_against_reference(stats, SC, mode)


DIST = Scenario(name="observe-dist", num_ranks=2, num_experts=8, topk=3, hidden=40, seed=22)


def _over_collectives() -> dict:
    return {mode: _recorded(None, DIST, mode, transport="dist").to_dict() for mode in ("normal", "ll")}


@pytest.mark.timeout(240)
def test_traffic_and_load_match_reference_over_collectives():
    got = ubep.LocalLaunch(world_size=2, timeout_s=120).run(_over_collectives)
    for mode, stats in got[0].items():
        _check_against_reference(Stats.from_dict(stats), DIST, mode)


def test_expert_load_per_layer_slot():
    """One Buffer for two layers: dispatch i counts towards layer i % 2 (vLLM's [layers, E])."""
    first, second = SC, Scenario(name="observe-2", num_ranks=3, num_experts=12, topk=3, hidden=40, seed=23)

    def two_layers(rank):
        with ubep.Buffer(
            rank, hidden=40, num_experts=12, max_tokens_per_rank=24, stats=StatsOptions(layers=2)
        ) as buf:
            for sc in (first, second, first):
                _normal_calls(buf, sc, rank.rank)
            return buf.stats(merge=True)

    stats = VirtualWorld(3, timeout_s=120).run(two_layers)[0]
    assert torch.equal(stats.expert_load_LE, torch.stack([2 * expected_load(first), expected_load(second)]))


# -- the straggler report --------------------------------------------------------------------------

DELAY_S, SLOW, DELAYED_CALL = 0.05, 1, 5  # call 5 is the third dispatch


def _straggling(delay_s: float) -> dict | None:
    me, R = dist.get_rank(), dist.get_world_size()
    sc = Scenario(name="straggler", num_ranks=R, num_experts=4 * R, tokens=(16,) * R, seed=24)
    plan = FaultPlan(rank=SLOW, point="dispatch.start", action="delay", call=DELAYED_CALL, delay_s=delay_s)
    with ubep.Buffer(
        hidden=sc.hidden,
        num_experts=sc.num_experts,
        max_tokens_per_rank=sc.capacity,
        transport="shm",
        faults=plan,
        stats=True,
    ) as buf:
        for _ in range(4):
            _normal_calls(buf, sc, me)
        stats = buf.stats(merge=True)
    return stats.to_dict() if me == 0 else None


@pytest.mark.timeout(240)
def test_straggler_report_names_the_delayed_rank_and_its_delay():
    got = ubep.LocalLaunch(world_size=3, timeout_s=120).run(_straggling, DELAY_S)
    stats = Stats.from_dict(got[0])
    report = observe.stragglers(stats)
    assert report.rank == SLOW, report.text()
    assert report.worst.seq == DELAYED_CALL and report.half == "dispatch", report.text()
    assert abs(report.worst.late_us - DELAY_S * 1e6) <= 0.2 * DELAY_S * 1e6, report.text()
    assert f"rank {SLOW} held the others up most" in report.text()
    wait_RR = stats.wait_matrix_RR("dispatch")  # the others waited for the slow rank, it for nobody
    others = [r for r in range(3) if r != SLOW]
    assert all(wait_RR[r, SLOW] > wait_RR[SLOW].max() for r in others), wait_RR
    waited_R = stats.waited_us_R("dispatch")  # per rank: the others waited, the slow rank did not
    assert int(waited_R.argmin()) == SLOW
    assert all(waited_R[r] > 0.8 * DELAY_S * 1e6 / 4 for r in others)  # the delay, in one of 4 dispatches

    trace = observe.chrome_trace(stats)  # the trace shows who waited for whom
    waits = [e for e in trace["traceEvents"] if e["name"] == f"waiting for rank {SLOW}"]
    assert {e["pid"] for e in waits if e["args"]["seq"] == DELAYED_CALL} == set(others)


# -- exporters -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merged() -> Stats:
    return VirtualWorld(SC.num_ranks, timeout_s=120).run(lambda rank: _recorded(rank, SC, "normal"))[0]


def test_trace_is_valid_trace_event_json(merged, tmp_path):
    path = tmp_path / "trace.json"
    observe.write_trace(merged, path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} >= set(range(SC.num_ranks))
    for e in slices:  # the fields every complete event must carry, with their types
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0 and e["dur"] >= 0
    names = [e for e in events if e["ph"] == "M"]
    assert {e["args"]["name"] for e in names if e["name"] == "process_name"} == {"rank 0", "rank 1", "rank 2"}
    calls = [e for e in slices if e["name"] in ("dispatch", "combine")]
    assert len(calls) == 2 * SC.num_ranks  # one dispatch and one combine per rank


def test_prometheus_text_parses_with_prometheus_client(merged):
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(observe.prometheus_text(merged))}
    assert families["ubep_sent_rows"].type == "counter"
    sent_RR = expected_dispatch_rows(SC)
    want = sent_RR + sent_RR.T
    for sample in families["ubep_sent_rows"].samples:
        s, d = int(sample.labels["source"]), int(sample.labels["destination"])
        assert sample.name == "ubep_sent_rows_total" and sample.value == want[s, d]
    load = expected_load(SC)
    for sample in families["ubep_expert_tokens"].samples:
        assert sample.value == load[int(sample.labels["expert"])]
    assert {s.labels["kind"] for s in families["ubep_calls"].samples} == {"dispatch", "combine"}
    assert len(families["ubep_peer_wait_seconds"].samples) == SC.num_ranks**2


def test_report_command_and_heatmap(merged, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from ubep.cli import main

    merged.save(tmp_path / "stats.json")
    out = tmp_path / "heat.png"
    assert main(["report", str(tmp_path / "stats.json"), "--heatmap", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "straggler: rank" in printed and "dispatch: 1 calls" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_reads_true_scales_whole_ranks_and_whole_labels(merged):
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ubep.observe.heatmap import heatmap_figure

    fig = heatmap_figure(merged)
    FigureCanvasAgg(fig).draw()  # lays the figure out, as saving it does
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    axes = [ax for ax in fig.axes if ax.get_images()]  # the panels, not their colour bars
    assert len(axes) == 3
    for ax in axes:
        (image,) = ax.get_images()
        assert image.norm.vmin == 0  # the colour scale starts at zero, not at the smallest cell
        rows, cols = image.get_array().shape
        for ticks, n in ((ax.get_xticks(), cols), (ax.get_yticks(), rows)):
            shown = [t for t in ticks if -0.5 <= t <= n - 0.5]
            assert shown and all(float(t).is_integer() for t in shown), list(ticks)
        for label in (ax.xaxis.label, ax.yaxis.label):
            extent = label.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0, label.get_text()


def test_report_names_every_file_it_wrote(merged, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("prometheus_client")
    from ubep.cli import main

    merged.save(tmp_path / "stats.json")
    paths = {
        "--trace": tmp_path / "t.json",
        "--prometheus": tmp_path / "m.prom",
        "--heatmap": tmp_path / "h.png",
    }
    exports = [arg for flag, path in paths.items() for arg in (flag, str(path))]
    assert main(["report", str(tmp_path / "stats.json"), *exports]) == 0
    wrote = [
        line.split()[1].rstrip(":")
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("wrote ")
    ]
    assert wrote == [str(p) for p in paths.values()] and all(p.stat().st_size > 0 for p in paths.values())


MISSING_EXTRAS = [("--heatmap", "matplotlib", "observe"), ("--prometheus", "prometheus_client", "observe")]


@pytest.mark.parametrize(("flag", "module", "extra"), MISSING_EXTRAS)
def test_report_refuses_a_missing_extra_before_it_prints_anything(
    merged, tmp_path, capsys, monkeypatch, flag, module, extra
):
    from ubep.cli import main

    monkeypatch.setitem(sys.modules, module, None)  # as without the extra: importing it raises
    merged.save(tmp_path / "stats.json")
    with pytest.raises(SystemExit) as done:
        main(["report", str(tmp_path / "stats.json"), flag, str(tmp_path / "out")])
    assert done.value.code == (
        f"ubep report {flag} needs {module} (the {extra!r} extra: pip install '.[{extra}]' in ubep's clone)"
    )
    assert capsys.readouterr().out == "" and not (tmp_path / "out").exists()


def small_snapshot() -> dict:
    """A valid merged snapshot of 2 ranks and 4 experts, written by hand (the file format's fields)."""
    rec = dict(seq=1, kind="dispatch", rank=0, ready_ns=10, sent_ns=10, end_ns=30, rows_R=[1, 2],
               row_bytes=8, tokens=3, recv_rows=2)  # fmt: skip
    return {
        "ranks": [0, 1],
        "num_ranks": 2,
        "num_experts": 4,
        "calls": {"dispatch": 1},
        "time_ns": {"dispatch": [20, 25]},
        "traffic_rows_RR": [[1, 2], [0, 1]],
        "traffic_bytes_RR": [[8, 16], [0, 8]],
        "expert_load_LE": [[1, 0, 2, 1]],
        "recent": [rec, {**rec, "rank": 1, "rows_R": [0, 1]}],
    }


def changed(path: str, value) -> dict:
    """small_snapshot() with the field at `path` ("recent.0.rank"; "recent.0.-tokens" drops tokens)
    set to `value`."""
    snapshot = small_snapshot()
    *parents, last = path.split(".")
    node = snapshot
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if last.startswith("-"):
        del node[last[1:]]
    else:
        node[int(last) if isinstance(node, list) else last] = value
    return snapshot


WRONG_SHAPES = [  # (the file's JSON, what the error must name), issue 32 item 7
    ([small_snapshot()], "the file: expected an object"),
    (changed("ranks", 3), "ranks: expected a list"),
    (changed("ranks", [0, "1"]), "ranks[1]: expected a rank id in [0, 2)"),
    (changed("ranks", [0, 2]), "ranks[1]: expected a rank id in [0, 2), got 2"),
    (changed("ranks", [1, 1]), "ranks: expected distinct rank ids"),
    (changed("num_ranks", True), "num_ranks: expected an int >= 1, got true"),
    (changed("time_ns", {}), "time_ns: expected the kinds of calls (dispatch)"),
    (changed("time_ns.dispatch", [20]), "time_ns.dispatch: expected a list of 2 entries"),
    (changed("calls.dispatch", "3"), 'calls.dispatch: expected an int >= 0, got "3"'),
    (changed("calls", {"shuffle": 1}), "calls: unexpected kind 'shuffle'"),
    (changed("traffic_rows_RR", [[1, 2]]), "traffic_rows_RR: expected a list of 2 entries"),
    (changed("traffic_bytes_RR.1", [0, -8]), "traffic_bytes_RR[1][1]: expected an int >= 0, got -8"),
    (changed("expert_load_LE", None), "expert_load_LE: expected a list, got null"),
    (changed("expert_load_LE.0", [1, 0, 2]), "expert_load_LE[0]: expected a list of 4 entries"),
    (changed("recent.0.extra", 1), "recent[0]: unexpected field 'extra'"),
    (changed("recent.1.-tokens", None), "recent[1]: missing field 'tokens'"),
    (changed("recent.1.rank", 7), "recent[1].rank: expected one of the ranks (0, 1), got 7"),
    (changed("recent.0.rows_R", [1]), "recent[0].rows_R: expected a list of 2 entries"),
    (changed("recent.0.kind", 5), "recent[0].kind: expected one of dispatch, combine, ll_dispatch"),
    (changed("-calls", None), "the file: missing field 'calls'"),
    (changed("version", 2), "the file: unexpected field 'version'"),
    # issue 45, item 15: totals past int64 printed negative traffic; one entry past it, a traceback
    (
        changed("traffic_rows_RR", [[2**62, 2**62], [0, 1]]),
        f"traffic_rows_RR: its entries add up to {2**63 + 1}, more than int64",
    ),
    (
        changed("expert_load_LE.0", [2**62, 2**62, 0, 0]),
        f"expert_load_LE: its entries add up to {2**63}, more than int64",
    ),
    (changed("traffic_bytes_RR.0", [2**63, 0]), "traffic_bytes_RR[0][0]: expected an int64"),
    (changed("recent.0.ready_ns", 10**400), "recent[0].ready_ns: expected an int64"),
]


@pytest.mark.parametrize("snapshot,said", WRONG_SHAPES, ids=[said.split(":")[0] for _, said in WRONG_SHAPES])
def test_report_names_the_field_of_a_file_of_the_wrong_shape(snapshot, said, tmp_path):
    from ubep.cli import main

    path = tmp_path / "stats.json"
    path.write_text(json.dumps(snapshot))
    with pytest.raises(SystemExit) as caught:  # a message, not a traceback
        main(["report", str(path)])
    assert str(caught.value).startswith(f"ubep report: cannot read {path}: {said}"), caught.value


@pytest.mark.parametrize("where", ["top", "ranks"])
def test_report_refuses_json_nested_too_deep_in_one_line(where, tmp_path):
    """100,000 nested lists (issue 45, item 15: a RecursionError traceback), at the top or in a field."""
    from ubep.cli import main

    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "stats.json"
    path.write_text(
        deep
        if where == "top"
        else json.dumps(small_snapshot()).replace('"ranks": [0, 1]', f'"ranks": {deep}')
    )
    with pytest.raises(SystemExit) as caught:
        main(["report", str(path)])
    assert str(caught.value) == (
        f"ubep report: cannot read {path}: its JSON nests deeper than Python's parser follows "
        "(a snapshot nests 4 levels)"
    )


def test_report_reads_a_hand_written_snapshot(tmp_path, capsys):
    from ubep.cli import main

    path = tmp_path / "stats.json"
    path.write_text(json.dumps(small_snapshot()))
    assert main(["report", str(path)]) == 0
    assert "dispatch: 1 calls, 0.0 us each" in capsys.readouterr().out


# -- settings, provenance, logging ----------------------------------------------------------------


def test_settings_come_from_arguments_then_environment_then_defaults():
    env = {"UBEP_TIMEOUT_S": "7.5", "UBEP_ENGINE": "torch", "UBEP_STATS": "yes"}
    got = settings.resolve({"engine": "numba", "protocol": None}, env)
    assert got["engine"] == settings.Setting("numba", "argument")  # an explicit argument wins
    assert got["timeout_s"] == settings.Setting(7.5, "UBEP_TIMEOUT_S")
    assert got["stats"] == settings.Setting(True, "UBEP_STATS")
    assert got["protocol"] == settings.Setting("ubep", "default")
    bad_values = ({"UBEP_TIMEOUT_S": "-1"}, {"UBEP_TIMEOUT_S": "soon"}, {"UBEP_STATS": "maybe"},
                  {"UBEP_PROTOCOL": "nccl"}, {"UBEP_ENGINE": "cuda"}, {"UBEP_TRANSPORT": "rdma"},
                  {"UBEP_TIMEOUT_S": "inf"}, {"UBEP_TIMEOUT_S": "1e300"},
                  {"UBEP_TIMEOUT_S": "nan"})  # fmt: skip
    for bad in bad_values:
        with pytest.raises(ValueError, match=next(iter(bad))):
            settings.resolve({}, bad)


@pytest.mark.parametrize("text", ["²", "LOUD", "-5", "1e3"])
def test_a_log_level_that_is_no_level_names_the_variable(text):
    with pytest.raises(ValueError, match=f"UBEP_LOG_LEVEL={text!r}: expected DEBUG, INFO"):
        settings.configure_logging({"UBEP_LOG_LEVEL": text})


def test_buffer_takes_environment_settings_and_explains_them(monkeypatch):
    monkeypatch.setenv("UBEP_TIMEOUT_S", "12")
    monkeypatch.setenv("UBEP_PROTOCOL", "bsp")
    monkeypatch.setenv("UBEP_STATS", "1")
    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4) as buf:
        assert buf.timeout_s == 12.0 and buf.protocol == "bsp"
        assert "timeout_s 12.0 (from UBEP_TIMEOUT_S)" in buf.explain()
        assert "protocol 'bsp' (from UBEP_PROTOCOL)" in buf.explain()
        assert "engine 'auto' (default)" in buf.explain()
        lines = buf.explain().splitlines()  # one line per topic, one per setting
        assert [line.split()[0] for line in lines[1:5]] == ["transport", "engine", "call", "settings"]
        assert (
            "    timeout_s 12.0 (from UBEP_TIMEOUT_S)" in lines
            and "    stats True (from UBEP_STATS)" in lines
        )
        buf.stats()  # recording is on
    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4, timeout_s=5, stats=False) as buf:
        assert buf.timeout_s == 5.0 and "timeout_s 5 (argument)" in buf.explain()
        with pytest.raises(RuntimeError, match="stats=True"):
            buf.stats()


def test_compat_deep_ep_buffer_takes_environment_settings(monkeypatch):
    from ubep.compat import deep_ep

    monkeypatch.setenv("UBEP_TIMEOUT_S", "9")
    monkeypatch.setenv("UBEP_STATS", "1")
    buf = deep_ep.Buffer(None, num_nvl_bytes=1 << 20)
    x, idx = torch.randn(4, 64).bfloat16(), torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=torch.ones(4, 2))  # fmt: skip
    assert "timeout_s 9.0 (from UBEP_TIMEOUT_S)" in buf.explain()
    assert "stats True (from UBEP_STATS)" in buf.explain()
    (recorded,) = buf.stats().values()
    assert recorded.calls == {"dispatch": 1} and recorded.expert_load_E.tolist() == [2, 2, 2, 2]


def test_debug_log_has_one_line_per_call(caplog):
    caplog.set_level(logging.DEBUG, logger=settings.LOGGER)
    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4, stats=False) as buf:
        got = buf.dispatch(
            torch.ones(2, 8), topk_idx=torch.tensor([[0, 1], [2, -1]]), topk_weights=torch.ones(2, 2)
        )
        buf.combine(got.recv_x, got.handle)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(lines) == 2, lines
    assert lines[0].startswith("rank 0 dispatch #1: 2 tokens in, sent 2 rows") and "combine #2" in lines[1]


def test_without_stats_nothing_stands_between_buffer_and_exchange():
    with ubep.Buffer(hidden=8, num_experts=4, max_tokens_per_rank=4, stats=False) as buf:
        assert "Recorded" not in type(buf._exchange).__name__


# -- the transformers integration -----------------------------------------------------------------


def _transformers_layers(path: str) -> dict:
    """One forward of a tiny Mixtral under EP with the settings from the environment only."""
    import os

    import transformers

    import ubep.integrations.transformers as ubep_tf

    os.environ |= {"UBEP_STATS": "1", "UBEP_TIMEOUT_S": "45"}  # what a job script would export
    R, me = dist.get_world_size(), dist.get_rank()
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, distributed_config=ubep_tf.distributed_config(config, R)
    )
    ids = torch.randint(0, config.vocab_size, (2, 3 + me), generator=torch.Generator().manual_seed(me))
    with torch.no_grad():
        model(ids)
    stats = ubep_tf.model_stats(model, merge=True)
    explained = model.model.layers[0].mlp.experts.ubep_ep.shared.buffer.explain()
    return {"stats": stats.to_dict(), "explain": explained}


@pytest.mark.timeout(300)
def test_transformers_layers_record_stats_from_the_environment(tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_transformers_ep import tiny_configs

    config = tiny_configs()["mixtral"]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    got = ubep.LocalLaunch(world_size=2, timeout_s=240).run(_transformers_layers, str(tmp_path))[0]
    assert "timeout_s 45.0 (from UBEP_TIMEOUT_S)" in got["explain"]
    stats = Stats.from_dict(got["stats"])  # the one Buffer every MoE layer shares: a load row per layer
    layers = config.num_hidden_layers
    assert stats.calls["dispatch"] == layers and stats.expert_load_LE.shape == (
        layers,
        config.num_local_experts,
    )
    tokens = (2 * 3) + (2 * 4)  # both ranks' batches
    for load_E in stats.expert_load_LE:
        assert int(load_E.sum()) == tokens * config.num_experts_per_tok


# -- the bench -------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_bench_stats_row_trace_and_slowed_rank(tmp_path, capsys):
    from ubep.cli import main

    stats_path, trace_path, out = tmp_path / "stats.json", tmp_path / "trace.json", tmp_path / "bench.json"
    shape = "--mode ll --ranks 2 --tokens 8 --hidden 256 --experts 8 --topk 2 --iters 3 --warmup 1"
    observed = f"--stats {stats_path} --trace {trace_path} --json {out} --slow-rank 1 --delay-us 30000"
    code = main(["bench", *shape.split(), "--systems", "ubep", *observed.split()])
    assert code == 0
    assert {r["system"] for r in json.loads(out.read_text())["results"]} == {"ubep", "ubep-stats"}
    printed = capsys.readouterr().out
    assert "stats overhead at 8 tokens/rank: ubep-stats / ubep" in printed
    assert "straggler: rank 1 held the others up most" in printed
    stats = Stats.load(stats_path)
    assert stats.merged and stats.calls == {"ll_dispatch": 5, "ll_combine": 5}  # 1 checked + 4 rounds
    assert observe.stragglers(stats).rank == 1
    assert any(e["name"] == "receive" for e in json.loads(trace_path.read_text())["traceEvents"])
