"""Every bundled GPU memory snapshot replays through the allocator model: from-empty traces give
the recorded segment events exactly and the peak within 1 %, mid-run traces the peak within 2 %
(`pipemem validate allocator`); and bad snapshot input is refused in one line."""

import gzip
import json
import pickle
from pathlib import Path

import pytest

from pipemem.allocator import snapshot as S
from pipemem.cli.main import main
from pipemem.errors import UserError
from pipemem.validation import allocator as V

FILES = V.snapshot_files(V.DATA)
ROOT = Path(__file__).resolve().parents[1]


def test_every_bundled_snapshot_reproduces():
    assert len(FILES) >= 80
    rows = [r for f in FILES for r in V.compare_file(f)]
    bad = [(r.name, r.rel_error, r.extra["segment_events"]) for r in rows if not r.extra["ok"]]
    assert not bad
    assert all(r.extra["final_segments"] == "same" for r in rows)
    assert sum(r.extra["start"] == "empty" for r in rows) >= 10


def test_validate_allocator_json(capsys, tmp_path):
    for f in FILES[:2]:
        (tmp_path / f.name).write_bytes(f.read_bytes())
    rc = main(["validate", "allocator", "--json", "--dir", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["truth"] == "measured" and out["cases"]
    assert {"name", "measured_bytes", "estimated_bytes", "rel_error"} <= set(out["cases"][0])


def test_snapshot_cli_json_and_what_if(capsys):
    f = next(p for p in FILES if "profile_grad" in p.name)
    assert main(["snapshot", str(f), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    dev = out["devices"][0]
    assert dev["modelled"]["segment_events"] == dev["recorded"]["segment_events"]
    assert main(["snapshot", str(f), "--alloc-conf", "expandable_segments:True", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["devices"][0]["what_if"]
    assert all(a == "segment_map" for a, _ in w["segment_events"])


def _write(tmp_path, name, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def test_pickle_with_a_global_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    path = _write(tmp_path, "evil.pickle", pickle.dumps({"segments": [], "device_traces": [Evil()]}))
    assert main(["snapshot", path]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "system" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


def test_plain_pickle_reads(tmp_path):
    snap = {
        "segments": [],
        "device_traces": [
            [
                {"action": "alloc", "addr": 1 << 30, "size": 100, "stream": 0},
                {"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0},
            ]
        ],
    }
    path = _write(tmp_path, "s.pickle", pickle.dumps(snap))
    assert S.load(path)["device_traces"][0][0]["size"] == 100


@pytest.mark.parametrize(
    "data",
    [
        # mtime=0: the gzip header carries a timestamp, and every pytest-xdist
        # worker must collect the same parameters
        gzip.compress(b'{"segments": [], "device_traces": []}', mtime=0)[:-12],
        b"\x1f\x8b\x08\x00garbage",
        pickle.dumps({"segments": [], "device_traces": []})[:-5],  # truncated pickle
        b'{"segments": [',  # truncated JSON
        b"hello",
        b'{"segments": "x", "device_traces": []}',
    ],
    ids=[
        "truncated-gzip",
        "gzip-garbage",
        "truncated-pickle",
        "truncated-json",
        "not-a-snapshot",
        "segments-not-a-list",
    ],
)
def test_corrupt_snapshots_exit_2(tmp_path, capsys, data):
    path = _write(tmp_path, "bad.json.gz", data)
    assert main(["snapshot", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipemem: error: snapshot") and len(err.strip().splitlines()) == 1


def test_unknown_alloc_conf_key_exit_2(capsys):
    assert main(["snapshot", str(FILES[0]), "--alloc-conf", "expandable:True"]) == 2
    err = capsys.readouterr().err
    assert "--alloc-conf" in err and "expandable" in err


def test_loader_never_calls_find_class():
    with pytest.raises(UserError):
        S.loads(pickle.dumps(Path("/x")), "p")


def test_readme_snapshot_example_runs(capsys):
    import re
    import shlex

    text = (ROOT / "README.md").read_text()
    cmds = re.findall(r"^pipemem snapshot .+$", text, flags=re.M)
    assert cmds
    for cmd in cmds:
        argv = shlex.split(cmd)[1:]
        argv = [str(ROOT / a) if a.startswith("bench/") else a for a in argv]
        assert main(argv) == 0
        assert "what if expandable_segments:True" in capsys.readouterr().out


def _oom_snapshot():
    MiB = 1 << 20
    X, Y = 1 << 40, (1 << 40) + (1 << 30)
    ev = [
        ("segment_alloc", X, 40 * MiB),
        ("alloc", X, 40 * MiB),
        ("segment_alloc", Y, 40 * MiB),
        ("alloc", Y, 40 * MiB),
        ("free_requested", X, 40 * MiB),
        ("free_completed", X, 40 * MiB),
        # a 70 MiB request: cudaMalloc fails (80 + 70 > 100), the cache is released, still no room
        ("segment_free", X, 40 * MiB),
        ("oom", 60 * MiB, 70 * MiB),
    ]
    trace = [{"action": a, "addr": ad, "size": sz, "stream": 0} for a, ad, sz in ev]
    segs = [
        {
            "device": 0,
            "address": Y,
            "total_size": 40 * MiB,
            "stream": 0,
            "segment_type": "large",
            "is_expandable": False,
            "blocks": [
                {"address": Y, "size": 40 * MiB, "requested_size": 40 * MiB, "state": "active_allocated"}
            ],
        }
    ]
    return {"segments": segs, "device_traces": [trace], "allocator_settings": None}


def test_recorded_oom_replays_and_what_if_uses_its_capacity(tmp_path, capsys):
    snap = _oom_snapshot()
    rec = S.recorded(snap, 0)
    assert rec.from_empty and rec.ooms == 1 and rec.peak_reserved_bytes == 80 << 20
    assert S.oom_capacity(snap, 0) == 100 << 20  # 40 MiB reserved at the OOM + 60 MiB free
    mod = S.replay_device(snap, 0)
    assert mod.segment_events == rec.segment_events
    path = _write(tmp_path, "oom.json", json.dumps(snap).encode())
    assert main(["snapshot", path, "--alloc-conf", "max_split_size_mb:30", "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["devices"][0]["what_if"]
    assert w["capacity_bytes"] == 100 << 20 and w["oom"] is True


def test_what_if_under_the_recorded_settings_gives_the_recorded_peak():
    """A what-if replay under the snapshot's own settings is the faithful replay again."""
    for f in FILES:
        if not any(k in f.name for k in ("MercuryB1", "memory_2.7b_forward", "ctx256_forward_", "Maphsge4")):
            continue
        snap = S.load(str(f))
        for d in S.devices(snap):
            cfg = S.snapshot_config(snap)
            same = S.replay_device(snap, d, config=cfg, capacity_bytes=S.oom_capacity(snap, d))
            assert same.peak_reserved_bytes == S.recorded(snap, d).peak_reserved_bytes, f.name


@pytest.mark.parametrize(
    "snap",
    [
        {"segments": [], "device_traces": [[{"action": "alloc", "addr": "x", "size": 5}]]},
        {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": -5}]]},
        {"segments": [{"address": 1, "total_size": 2, "blocks": [{"address": 1}]}], "device_traces": []},
        {"segments": [{"address": 1.5, "total_size": 2}], "device_traces": []},
        [1, 2],
    ],
)
def test_malformed_snapshot_content_is_refused(snap):
    with pytest.raises(UserError) as e:
        S.loads(json.dumps(snap).encode(), "s")
    assert "\n" not in str(e.value)


def test_events_torch_adds_are_ignored():
    snap = {
        "segments": [],
        "device_traces": [
            [{"action": "user_defined", "user_metadata": "x"}, {"action": "snapshot", "addr": None}]
        ],
    }
    assert S.recorded(S.loads(json.dumps(snap).encode()), 0).peak_reserved_bytes == 0


def test_traces_that_lost_or_repeat_events_replay_without_crashing():
    import copy
    import random

    from pipemem.allocator import AllocatorConfig

    rnd = random.Random(5)
    bases = [S.load(str(f)) for f in FILES if "device2" in f.name or "MercuryB1" in f.name]
    for _ in range(25):
        snap = copy.deepcopy(rnd.choice(bases))
        t = next(t for t in snap["device_traces"] if t)
        k = rnd.randrange(4)
        if k == 0:
            for _ in range(20):
                t.pop(rnd.randrange(len(t)))
        elif k == 1:
            rnd.shuffle(t)
        elif k == 2:
            for _ in range(20):
                t.insert(rnd.randrange(len(t)), dict(rnd.choice(t)))
        else:
            snap["segments"] = snap["segments"][: len(snap["segments"]) // 2]
        for d in S.devices(snap):
            S.replay_device(snap, d)
            S.replay_device(
                snap,
                d,
                config=AllocatorConfig.parse("expandable_segments:True"),
                capacity_bytes=rnd.choice([None, 8 << 30]),
            )


def test_one_device_extract_is_read_as_its_device():
    f = next(p for p in FILES if "device2" in p.name)
    snap = S.load(str(f))
    extract = dict(snap, device_traces=[t for t in snap["device_traces"] if t])  # the trace at index 0
    again = S.loads(json.dumps(extract).encode(), "x")
    assert S.devices(again) == [2]
    assert S.recorded(again, 2).segment_events == S.recorded(snap, 2).segment_events


def test_validate_allocator_fails_on_a_trace_the_model_does_not_reproduce(tmp_path, capsys):
    f = next(p for p in FILES if "profile_grad" in p.name)
    snap = S.load(str(f))
    seg = next(e for e in snap["device_traces"][0] if e["action"] == "segment_alloc")
    seg["size"] += 2 << 20  # a recorded segment 2 MiB larger than the allocator's rule gives
    final = next(s for s in snap["segments"] if s["address"] == seg["addr"])
    final["total_size"] += 2 << 20  # (and so in the final state: the trace still starts empty)
    (tmp_path / "tampered.json").write_text(json.dumps(snap))
    assert main(["validate", "allocator", "--json", "--dir", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["passed"] and out["segment_events_differ"] and out["cases"][0]["events_match"] == "NO"


_SEG = {"address": 0, "total_size": 2 << 20, "stream": 0, "blocks": [{"address": 0, "size": 512}]}
_EV = {"action": "alloc", "addr": 0, "size": 512, "stream": 0}


@pytest.mark.parametrize(
    "snap, word",
    [
        ({"segments": [{**_SEG, "address": True}]}, "segment"),  # a bool is not an int
        ({"segments": [{**_SEG, "stream": "0"}]}, "segment"),
        ({"segments": [{k: v for k, v in _SEG.items() if k != "total_size"}]}, "segment"),
        ({"segments": [{**_SEG, "blocks": {}}]}, "segment"),
        ({"segments": [{**_SEG, "blocks": [{"address": 0, "size": -1}]}]}, "block"),
        ({"segments": [{**_SEG, "blocks": [{"address": 0.0, "size": 512}]}]}, "block"),
        ({"device_traces": [[{**_EV, "stream": None}]]}, "event"),
        ({"device_traces": [[{**_EV, "addr": -2}]]}, "event"),
        ({"device_traces": [[{k: v for k, v in _EV.items() if k != "size"}]]}, "event"),
    ],
)
def test_snapshot_fields_must_be_ints_in_range(snap, word):
    with pytest.raises(UserError, match=word):
        S.loads(json.dumps(snap).encode(), "x")


def test_snapshot_fields_checked_accept_a_good_one():
    snap = {"segments": [_SEG], "device_traces": [[_EV, {k: v for k, v in _EV.items() if k != "stream"}]]}
    assert S.loads(json.dumps(snap).encode(), "x")["segments"][0]["blocks"][0]["size"] == 512
