"""Tracking with real W&B in offline mode, the null logger, and mode resolution."""

from __future__ import annotations

from schemafill.config import LoggerConfig
from schemafill.tracking import NullTracker, WandbTracker, provenance, resolve_mode, start_run


def test_offline_wandb_run_records_config_metrics_tables_and_artifacts(tmp_path):
    artifact = tmp_path / "metrics.json"
    artifact.write_text('{"al": 2.5}')
    tracker = start_run(LoggerConfig(mode="offline", dir=str(tmp_path)), {"model": {"name": "tiny"}},
                        name="test-run", job_type="test")
    assert isinstance(tracker, WandbTracker)
    assert tracker.run.config["model"] == {"name": "tiny"}
    assert tracker.run.config["_provenance"]["packages"]["torch"]
    tracker.log({"loss": 1.0}, step=0)
    tracker.log({"loss": 0.5}, step=1)
    tracker.table("table1", ["method", "al"], [["ar", 1.0], ["schemafill", 3.0]])
    tracker.summary({"final/al": 3.0})
    tracker.artifact(artifact, "metrics", "eval")
    tracker.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")) and (runs[0] / "files").is_dir()


def test_null_logger_keeps_what_it_was_given():
    tracker = start_run(LoggerConfig(backend="none"), {})
    assert isinstance(tracker, NullTracker)
    tracker.log({"a": 1}, step=3)
    tracker.table("t", ["x"], [[1]])
    tracker.summary({"b": 2})
    tracker.finish()
    assert tracker.history == [{"a": 1, "_step": 3}] and tracker.tables["t"] == (["x"], [[1]])
    assert tracker.summaries == {"b": 2}


def test_auto_mode_is_online_only_with_an_api_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    assert resolve_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"
    assert resolve_mode("offline") == "offline"


def test_provenance_names_git_sha_packages_and_hardware():
    info = provenance()
    assert set(info) == {"git_sha", "packages", "hardware"}
    assert info["hardware"]["cpus"] >= 1 and "cuda" in info["hardware"]
    assert info["git_sha"] is None or len(info["git_sha"]) == 40
