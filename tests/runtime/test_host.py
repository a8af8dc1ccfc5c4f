"""What the host is, read from /proc-style files: the one reader every probe's key goes through."""

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
