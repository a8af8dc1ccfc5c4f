"""What the host is, read from /proc-style files: the one reader every probe's key goes through; and
the per-host cache's hold on an entry while one process measures it."""

from __future__ import annotations

from schemafill.runtime import host


def test_a_proc_field_is_read_by_its_exact_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name extra\t: not this\nmodel name\t: AMD EPYC 9R14\nmodel name\t: second\n")
    assert host.proc_field(str(info), "model name") == "AMD EPYC 9R14"  # the first line of that exact name
    assert host.proc_field(str(info), "flags") is None
    assert host.proc_field(str(tmp_path / "missing"), "model name") is None


def test_the_timing_key_names_the_isa_caps_a_user_set(monkeypatch):
    plain = host.timing_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = host.timing_key()
    assert capped != plain and "AVX2" in capped and host.cpu_model() in plain
    assert host.available_memory() is None or host.available_memory() > 0


def test_one_process_measures_an_entry_while_the_others_wait(tmp_path):
    """``measuring``: a second prober of the same entry (its own open lock file, as another
    process has) enters only once the first has left; another entry is not held up."""
    import threading
    import time

    from schemafill.runtime import host_cache

    path = host_cache.entry(tmp_path / "backends", "key")
    events, entered = [], threading.Event()

    def first() -> None:
        with host_cache.measuring(path):
            entered.set()
            time.sleep(0.3)
            events.append("first leaves")

    def second() -> None:
        entered.wait()
        with host_cache.measuring(path):
            events.append("second enters")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    entered.wait()
    start = time.perf_counter()
    with host_cache.measuring(host_cache.entry(tmp_path / "backends", "another key")):
        other_waited = time.perf_counter() - start
    for t in threads:
        t.join()
    assert events == ["first leaves", "second enters"] and other_waited < 0.2
