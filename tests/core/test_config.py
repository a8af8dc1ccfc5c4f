"""Config composition: every option of every group composes into the dataclass schema,
and a wrong key or value fails naming it."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from schemafill.config import PipelineConfig, to_dataclass
from tests.conftest import CONF, compose

# conf/accelerate holds `accelerate launch --config_file` files, not a Hydra group;
# conf/target_defaults follows the chosen model and conf/experiment overrides any key
# (both tested below): neither is a section of the config
GROUPS = sorted(p.name for p in CONF.iterdir()
                if p.is_dir() and p.name not in ("accelerate", "target_defaults", "experiment"))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_of_every_group_composes(group, option):
    cfg = to_dataclass(compose([f"{group}={option}"]))
    assert isinstance(cfg, PipelineConfig)
    assert getattr(cfg, group) is not None


@pytest.mark.parametrize("option", options("target_defaults"))
def test_target_defaults_come_with_their_model_only(option):
    assert option in options("model")
    chosen = compose([f"model={option}"])
    other = compose(["model=qwen2.5-7b"])
    assert chosen.drafter.draft_vocab_size != other.drafter.draft_vocab_size  # applied with its model only
    assert compose([f"model={option}", "drafter.draft_vocab_size=123"]).drafter.draft_vocab_size == 123


def test_groups_are_the_documented_ones():
    assert set(GROUPS) >= {"model", "data", "drafter", "decode", "train", "logger"}
    assert set(options("model")) == {"smollm2-135m", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "hermes3-8b",
                                     "qwen2.5", "qwen3"}


@pytest.mark.parametrize("family,sized", [("qwen2.5", "qwen2.5-7b"), ("qwen3", "qwen3-8b")])
def test_family_names_are_the_papers_targets(family, sized):
    assert to_dataclass(compose([f"model={family}"])).model == to_dataclass(compose([f"model={sized}"])).model
    assert to_dataclass(compose(["model=qwen2.5"])).model.source == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("model,layers", [("qwen2.5-7b", [2, 14, 25]), ("qwen3-8b", [2, 18, 33]),
                                          ("mistral-7b", [2, 16, 29]), ("hermes3-8b", [2, 16, 29]),
                                          ("smollm2-135m", [2, 15, 27])])
def test_aux_layer_ids_follow_the_paper(model, layers):
    assert to_dataclass(compose([f"model={model}"])).model.aux_layer_ids == layers


def test_default_target_is_the_builtin_one():
    cfg = to_dataclass(compose())
    assert cfg.model.name == "smollm2-135m" and cfg.model.finetune
    assert cfg.paths.artifacts == "artifacts"


def test_misspelt_key_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["model.dtyp=bfloat16"])
    assert "dtyp" in str(err.value.__cause__ or err.value)


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["decode.topk=many"])
    assert "topk" in str(err.value.__cause__ or err.value)


def test_unknown_stage_is_rejected():
    with pytest.raises(ValueError, match="unknown stage"):
        to_dataclass(compose(["stages=[requests,bogus]"]))


def test_library_code_gets_dataclasses_not_dictconfig():
    cfg = to_dataclass(compose(["model=qwen3-8b"]))
    assert type(cfg.model).__name__ == "ModelConfig"
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}


def test_misspelt_key_in_a_yaml_file_names_the_key(tmp_path):
    import shutil

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "typo.yaml").write_text(
        (CONF / "model" / "qwen2.5-7b.yaml").read_text().replace("prompt_style:", "prompt_styel:"))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as err:
            hydra_compose(config_name="config", overrides=["model=typo"])
    assert "prompt_styel" in str(err.value.__cause__ or err.value)


def test_eagle_defaults_preset_is_the_wide_methods_budget():
    from infer.proposers.head import EAGLE_DEFAULTS, TreeBudget

    d = to_dataclass(compose(["decode=eagle_defaults", "logger=none"])).decode
    assert TreeBudget.of(d) == EAGLE_DEFAULTS
    paper = to_dataclass(compose(["decode=paper", "logger=none"])).decode
    assert {k: v for k, v in vars(d).items() if k not in ("topk", "depth", "total_tokens")} == \
        {k: v for k, v in vars(paper).items() if k not in ("topk", "depth", "total_tokens")}


def test_cost_aware_selection_is_the_default_and_the_paper_keeps_its_fixed_budget():
    from infer.proposers.head import SCHEMAFILL_BUDGET, TreeBudget

    default = to_dataclass(compose(["logger=none"])).decode
    paper = to_dataclass(compose(["decode=paper", "logger=none"])).decode
    assert default.select == "cost" and paper.select == "fixed"
    assert TreeBudget.of(paper) == SCHEMAFILL_BUDGET
    # the default's head tree is a deeper candidate pool, the rest is the paper's
    assert TreeBudget.of(default).depth > paper.depth
    # ... drafted one level deep beside a packed chain (the paper's drafts its full depth)
    assert (default.chain_head_depth, paper.chain_head_depth) == (1, 0)
    # ... and copies run further ahead, selection keeping what pays (the paper's verifies all 4)
    assert (default.copy_len, paper.copy_len) == (64, 4)
    # ... and the packer guesses where values and the response end (the paper's does not)
    assert (default.guess_ends, paper.guess_ends) == (True, False)
    # ... and values nobody prepared (the paper's leaves them to SIDE branches and the head)
    assert (default.value_guesses, paper.value_guesses) == (3, 0)
    differ = ("select", "depth", "total_tokens", "chain_head_depth", "copy_len", "guess_ends", "value_guesses")
    assert {k: v for k, v in vars(default).items() if k not in differ} == \
        {k: v for k, v in vars(paper).items() if k not in differ}
    with pytest.raises(Exception, match="decode.select must be one of"):
        to_dataclass(compose(["decode.select=cheap", "logger=none"]))


def test_bad_decode_values_are_named():
    with pytest.raises(Exception, match="decode.constrain must be one of"):
        to_dataclass(compose(["decode.constrain=always", "logger=none"]))
    with pytest.raises(Exception, match="decode.ablation must be one of"):
        to_dataclass(compose(["decode.ablation=E", "logger=none"]))
    with pytest.raises(Exception, match="decode.value_guesses must be 0 .off. or more, got -1"):
        to_dataclass(compose(["decode.value_guesses=-1", "logger=none"]))


def test_the_response_format_is_named_and_each_real_target_answers_in_its_own():
    assert to_dataclass(compose([])).model.response_format == "json"
    assert to_dataclass(compose(["model.response_format=hermes"])).model.response_format == "hermes"
    with pytest.raises(Exception, match=r"model.response_format must be one of \['hermes', 'hermes3', 'json', "
                                        r"'mistral'\], got 'xml'"):
        to_dataclass(compose(["model.response_format=xml"]))
    # every format has its grammar
    assert to_dataclass(compose(["model.response_format=mistral", "decode.constrain=schema"])).decode.constrain \
        == "schema"
    with pytest.raises(Exception, match="prompt_style=tools prompts with the target's own tool format"):
        to_dataclass(compose(["model.prompt_style=tools"]))
    # real targets answer natively; experiment=paper restores the paper's json setting per target
    native = to_dataclass(compose(["model=qwen2.5"]))
    paper = to_dataclass(compose(["model=qwen2.5", "experiment=paper"]))
    assert (native.model.response_format, native.model.prompt_style) == ("hermes", "tools")
    assert (paper.model.response_format, paper.model.prompt_style) == ("json", "plain")
    qwen3 = to_dataclass(compose(["model=qwen3", "experiment=paper"])).model
    assert (qwen3.response_format, qwen3.prompt_style) == ("json", "chat")
    assert qwen3.chat_template_kwargs == {"enable_thinking": False}
    for model, fmt in (("mistral-7b", "mistral"), ("hermes3-8b", "hermes3"), ("qwen3", "hermes")):
        native = to_dataclass(compose([f"model={model}"])).model
        assert (native.response_format, native.prompt_style) == (fmt, "tools")
    hermes = to_dataclass(compose(["experiment=hermes"]))
    assert (hermes.model.response_format, hermes.model.prompt_style, hermes.run_name) == \
        ("hermes", "tools", "smollm2-135m-hermes")


@pytest.mark.parametrize("option", options("experiment"))
def test_every_experiment_composes_over_the_defaults_and_yields_to_the_command_line(option):
    cfg = to_dataclass(compose([f"experiment={option}"]))
    assert isinstance(cfg, PipelineConfig) and cfg.tag == option
    full = to_dataclass(compose(["experiment=full", "eval.limit=5"]))
    # it wins over the built-in target's defaults (400 requests, time budgets), the command line over it
    assert full.data.continuations.max_requests == 0 and full.train.head.epochs == 2 and full.eval.limit == 5
    assert full.data.continuations.max_minutes == 0 and full.train.head.max_minutes == 0  # no budget cuts the pool
