"""probes/fields.py and probes/_summary.py on a small installed-looking ``megatron`` tree we write
ourselves: which class a section is, which keys it has, what type each holds, and a summary cache
that never answers for a file that changed."""

from __future__ import annotations

import typing

import pytest

from mbridge_mxfp8_plugin.common.yamltypes import EnumType, type_problem
from mbridge_mxfp8_plugin.probes import _summary, fields

CONFIG_PY = """
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from megatron.bridge.training.modes import Mode


class Backend(enum.Enum):
    flash = 1
    fused = 2


@dataclass
class TrainingConfig:
    train_iters: Optional[int] = None
    skip_train: bool = False
    backend: Backend = Backend.flash
    mode: Mode = Mode.fast
    recipe: Literal["a", "b"] = "a"
    interval: int = None


@dataclass
class DatasetProvider(ABC):
    seq_length: int = 0

    @abstractmethod
    def build(self): ...


@dataclass
class GPTDatasetConfig(DatasetProvider):
    path: str = ""


@dataclass
class ConfigContainer:
    train: TrainingConfig
    dataset: GPTDatasetConfig | DatasetProvider
    mixed_precision: Optional[Union[TrainingConfig, str]] = None
"""

MODES_PY = """
import enum


class Mode(str, enum.Enum):
    fast = "fast"
    safe = "safe"
"""


@pytest.fixture
def tree(tmp_path, monkeypatch):
    training = tmp_path / "megatron" / "bridge" / "training"
    training.mkdir(parents=True)
    (tmp_path / "megatron" / "bridge" / "__init__.py").write_text("")
    (training / "__init__.py").write_text("")
    (training / "train.py").write_text("def train(): pass\n")
    (training / "config.py").write_text(CONFIG_PY)
    (training / "modes.py").write_text(MODES_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for cached in (fields.section_fields, fields.container_sections):
        cached.cache_clear()
    _summary.summary.cache_clear()
    yield training
    for cached in (fields.section_fields, fields.container_sections):
        cached.cache_clear()
    _summary.summary.cache_clear()


def test_a_concrete_section_is_fixed_and_typed_from_its_annotations(tree):
    train = fields.section_fields("train")
    assert train.fixed and train.owner == "TrainingConfig"
    assert train.fields is not None
    assert (
        type_problem("ten", train.fields["train_iters"])
        and type_problem(None, train.fields["train_iters"]) is None
    )
    assert type_problem("yes", train.fields["skip_train"])
    # ``int = None`` is Optional in practice (core declares fields so).
    assert type_problem(None, train.fields["interval"]) is None
    assert typing.get_args(train.fields["recipe"]) == ("a", "b")


def test_enums_are_read_by_member_name_even_through_an_import(tree):
    train = fields.section_fields("train")
    assert train.fields is not None
    backend, mode = train.fields["backend"], train.fields["mode"]
    assert isinstance(backend, EnumType) and backend.members == ("flash", "fused")
    assert isinstance(mode, EnumType) and mode.members == ("fast", "safe")  # defined in modes.py
    assert type_problem("flash", backend) is None and type_problem("Backend.fused", backend) is None
    problem = type_problem("flsh", backend)
    assert problem is not None and "did you mean 'flash'" in problem


def test_a_union_or_an_abstract_class_is_open(tree):
    dataset = fields.section_fields("dataset")
    assert not dataset.fixed and dataset.fields is not None
    assert {"seq_length", "path"} <= set(dataset.fields)
    assert dataset.owner == "GPTDatasetConfig | DatasetProvider"


def test_the_summary_cache_is_rebuilt_when_the_file_changes(tree):
    path = tree / "config.py"
    first = _summary.summary(path)
    assert first is not None and "TrainingConfig" in first["classes"]
    assert list((tree.parents[2] / "cache" / "mbridge_mxfp8_plugin").glob("config-*.marshal"))
    path.write_text(CONFIG_PY.replace("class TrainingConfig:", "class TrainingConfig2:"))
    _summary.summary.cache_clear()
    second = _summary.summary(path)
    assert (
        second is not None
        and "TrainingConfig2" in second["classes"]
        and "TrainingConfig" not in second["classes"]
    )


def test_a_summary_read_from_the_cache_is_the_summary_built_from_the_source(tree):
    """The cached form (marshal) gives back exactly the built one: literal defaults, their types,
    and MISSING as the very sentinel the checks compare with ``is``."""
    path = tree / "config.py"
    built = _summary._build(path)
    assert _summary.summary(path) == built  # the first call builds and stores it
    _summary.summary.cache_clear()
    cached = _summary.summary(path)
    assert cached == built
    defaults = [d for c in cached["classes"].values() for _, _, d in c["fields"]]
    assert any(d is _summary.MISSING for d in defaults) and any(d is not _summary.MISSING for d in defaults)
    built_defaults = [d for c in built["classes"].values() for _, _, d in c["fields"]]
    assert [type(d) for d in defaults] == [type(d) for d in built_defaults]


def test_an_unwritable_cache_costs_only_the_parse(tree, monkeypatch):
    blocker = tree.parents[2] / "blocked"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    _summary.summary.cache_clear()
    info = _summary.summary(tree / "config.py")
    assert info is not None and "ConfigContainer" in info["classes"]


RECIPE_PY = """
from megatron.bridge.models.fam import FamProvider
from megatron.bridge.training.config import ConfigContainer


def fam_pretrain_config():
    cfg = ConfigContainer()
    model_cfg = FamProvider(hidden_size=64)
    cfg.model = model_cfg
    cfg.model.num_moe_experts = 8
    cfg.model.seq_length = 4096
    return cfg


def fam_hf_pretrain_config():
    cfg = ConfigContainer()
    cfg.model = AutoBridge.from_hf_pretrained("org/fam").to_megatron_provider(load_weights=False)
    return cfg
"""

FAM_PY = """
from dataclasses import dataclass
from typing import Optional


@dataclass
class FamProvider:
    hidden_size: int = 0
    num_moe_experts: Optional[int] = None
"""


def test_a_recipe_source_names_its_provider_and_the_model_knobs_it_sets(tree):
    from mbridge_mxfp8_plugin.probes import recipe_source

    recipes = tree.parent / "recipes" / "fam"
    recipes.mkdir(parents=True)
    (tree.parent / "recipes" / "__init__.py").write_text("")
    (recipes / "__init__.py").write_text("")
    (recipes / "fam.py").write_text(RECIPE_PY)
    (tree.parent / "models").mkdir()
    (tree.parent / "models" / "__init__.py").write_text("")
    (tree.parent / "models" / "fam.py").write_text(FAM_PY)
    recipe_source.find_recipe.cache_clear()
    found = recipe_source.find_recipe("fam_pretrain_config")
    assert found is not None and found.provider == "megatron.bridge.models.fam.FamProvider"
    assert found.model == {"num_moe_experts": 8, "seq_length": 4096}
    provider = fields.target_fields(found.provider)
    assert (
        provider.fixed
        and provider.fields is not None
        and set(provider.fields) == {"hidden_size", "num_moe_experts"}
    )
    hf = recipe_source.find_recipe("megatron.bridge.recipes.fam.fam.fam_hf_pretrain_config")
    assert hf is not None and hf.provider is None and "AutoBridge" in hf.provider_why
    assert recipe_source.find_recipe("no_such_config") is None
    recipe_source.find_recipe.cache_clear()
