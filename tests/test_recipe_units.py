"""Models by target, the zoo adapter, weights, EMA, the loss options, weight-decay groups,
precision=auto and callbacks, in one process."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
import torchvision
from helpers.paths import ROOT
from helpers.runs import compose_config
from torch.nn import functional as F

from ddp_utils.config import ConfigError, ConvNetModel, DataConfig, ModelConfig, OptimConfig
from ddp_utils.data import IGNORE_LABEL
from ddp_utils.hardware import Cuda
from ddp_utils.models import build_model
from ddp_utils.models.ema import EMA, ema_decay
from ddp_utils.optim import param_groups
from ddp_utils.tasks.classification import Criterion, build_mixing
from ddp_utils.train.callbacks import build_callbacks
from ddp_utils.train.precision import resolve_precision

RGB = dict(in_channels=3, mean=[0.5] * 3, std=[0.5] * 3)


def torchvision_cfg(arch: str) -> ModelConfig:
    return compose_config("model=torchvision", f"model.arch={arch}").model


def test_torchvision_models_by_name_with_adapted_stems():
    data = DataConfig(image_size=32, num_classes=7, **RGB)
    mobilenet = build_model(torchvision_cfg("mobilenet_v3_small"), data)
    reference = torchvision.models.get_model("mobilenet_v3_small", num_classes=7)
    mobilenet.load_state_dict(reference.state_dict())  # unchanged architecture at 3 channels
    assert mobilenet(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    grey = build_model(torchvision_cfg("efficientnet_b0"), DataConfig(image_size=40))
    assert grey(torch.randn(2, 1, 40, 40)).shape == (2, 10)
    small = build_model(torchvision_cfg("resnet50"), DataConfig(image_size=32, **RGB))
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    with pytest.raises(ConfigError, match="close matches: resnet50"):
        build_model(torchvision_cfg("resnet5O"), data)


def test_timm_models_when_timm_is_installed():
    pytest.importorskip("timm", reason="timm is the optional extra [timm]")
    cfg = compose_config("model=timm", "model.arch=resnet18").model
    model = build_model(cfg, DataConfig(image_size=32, num_classes=4))
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 4)


def test_custom_targets_get_what_their_signature_takes_and_clear_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = compose_config("model=custom", "model._target_=custom_models.TinyNet",
                         "+model.width=5").model  # fmt: skip
    model = build_model(cfg, DataConfig(image_size=8, num_classes=3))
    assert model.conv.out_channels == 5 and model(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    bad = compose_config("model=custom", "model._target_=custom_models.TinyNet",
                         "+model.depth=5").model  # fmt: skip
    with pytest.raises(ConfigError, match="custom_models.TinyNet rejected its arguments"):
        build_model(bad, DataConfig())
    gone = compose_config("model=custom", "model._target_=nowhere.Net").model
    with pytest.raises(ConfigError, match="nowhere.Net cannot be imported"):
        build_model(gone, DataConfig())
    with pytest.raises(ConfigError, match="model.lrr is not a key of model=convnet"):
        compose_config("+model.lrr=1")


def test_weights_load_and_a_head_of_another_class_count_is_reinitialised(tmp_path, caplog):
    cfg = torchvision_cfg("resnet18")
    data5 = DataConfig(image_size=96, num_classes=5, **RGB)
    source = build_model(cfg, data5)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    same = build_model(replace(cfg, weights=str(tmp_path / "w.pt")), data5)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in same.state_dict().items())
    with caplog.at_level("INFO", logger="ddp_recipes"):
        other = build_model(
            replace(cfg, weights=str(tmp_path / "w.pt")),
            DataConfig(image_size=96, num_classes=10, **RGB),
        )
    assert "re-initialised for 10 classes" in caplog.text
    assert torch.equal(other.conv1.weight, source.conv1.weight) and other.fc.out_features == 10
    mlp = compose_config("model=mlp").model
    with pytest.raises(ConfigError, match="does not match the model: missing"):
        build_model(replace(mlp, weights=str(tmp_path / "w.pt")),
                    DataConfig())  # fmt: skip


@pytest.mark.parametrize("group, arch, layers", [
    ("torchvision_seg", "lraspp_mobilenet_v3_large",
     "classifier.high_classifier, classifier.low_classifier"),
    ("torchvision_det", "fasterrcnn_mobilenet_v3_large_320_fpn",
     "roi_heads.box_predictor.bbox_pred, roi_heads.box_predictor.cls_score"),
])  # fmt: skip
def test_segmentation_and_detection_weights_get_a_new_head_for_another_class_count(
    tmp_path, caplog, group, arch, layers
):
    cfg = compose_config(f"model={group}", f"model.arch={arch}").model
    source = build_model(cfg, DataConfig(image_size=64, num_classes=5, **RGB))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    with caplog.at_level("INFO", logger="ddp_recipes"):
        model = build_model(replace(cfg, weights=str(tmp_path / "w.pt")),
                            DataConfig(image_size=64, num_classes=3, **RGB))  # fmt: skip
    assert f"replaced layers {layers} (sized for another class count" in caplog.text
    theirs = source.state_dict()
    kept = [k for k, v in model.state_dict().items() if v.shape == theirs[k].shape]
    assert kept and all(torch.equal(model.state_dict()[k], theirs[k]) for k in kept)
    assert len(kept) < len(theirs)


def test_a_torchvision_weights_name_is_read_from_the_hub_cache_without_network(
    tmp_path, monkeypatch, caplog
):
    """``model.weights=ResNet18_Weights.IMAGENET1K_V1``: the file torchvision would have
    downloaded, found in $TORCH_HOME/hub/checkpoints; a 1000-class head is replaced for the
    data's classes, and the log names it. Missing, the path to put it at is named."""
    import torchvision

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg = replace(torchvision_cfg("resnet18"), weights="ResNet18_Weights.IMAGENET1K_V1")
    data = DataConfig(image_size=96, num_classes=10, **RGB)
    url = torchvision.models.get_weight("ResNet18_Weights.IMAGENET1K_V1").url
    cached = tmp_path / "torch" / "hub" / "checkpoints" / Path(url).name
    with pytest.raises(ConfigError, match=f"{cached} is not in the torch hub cache"):
        build_model(cfg, data)
    imagenet = torchvision.models.resnet18()  # what the download would hold: 1000 classes
    cached.parent.mkdir(parents=True)
    torch.save(imagenet.state_dict(), cached)
    with caplog.at_level("INFO", logger="ddp_recipes"):
        model = build_model(cfg, data)
    assert torch.equal(model.layer4[1].conv2.weight, imagenet.layer4[1].conv2.weight)
    assert model.fc.out_features == 10 and "replaced layers fc " in caplog.text
    with pytest.raises(ConfigError, match="neither a file nor a torchvision weights name"):
        build_model(replace(cfg, weights="ResNet18_Weights.NOPE"), data)


def test_a_timm_weights_name_is_read_from_the_hub_caches_without_network(
    tmp_path, monkeypatch, caplog
):
    """``model.weights=timm/resnet18.a1_in1k``: timm's file in the Hugging Face hub cache (or,
    for weights timm still fetches by URL, the torch hub cache); missing, both are named."""
    timm = pytest.importorskip("timm")
    import huggingface_hub.constants
    from safetensors.torch import save_file

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg = replace(compose_config("model=timm", "model.arch=resnet18").model,
                  weights="timm/resnet18.a1_in1k")  # fmt: skip
    data = DataConfig(image_size=64, num_classes=10, **RGB)
    with pytest.raises(ConfigError, match="is in neither the Hugging Face hub cache .* nor "
                                          ".*resnet18_a1_0-d63eafa0.pth"):  # fmt: skip
        build_model(cfg, data)
    imagenet = timm.create_model("resnet18", num_classes=1000)
    repo = tmp_path / "hf" / "models--timm--resnet18.a1_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    save_file(imagenet.state_dict(), repo / "snapshots" / "abc" / "model.safetensors")
    with caplog.at_level("INFO", logger="ddp_recipes"):
        model = build_model(cfg, data)
    assert torch.equal(model.layer4[1].conv2.weight, imagenet.layer4[1].conv2.weight)
    assert model.fc.out_features == 10 and "replaced layers fc " in caplog.text


def test_label_smoothing_is_the_textbook_formula():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 4), torch.tensor([0, 3, 1, IGNORE_LABEL, 2, 2])
    got = Criterion(4, 0.1, None).loss_sum(logits, labels)
    logp = logits.log_softmax(1)
    real = labels != IGNORE_LABEL
    hand = -(0.9 * logp[real, labels[real]] + 0.1 / 4 * logp[real].sum(1)).sum()
    assert torch.allclose(got, hand, atol=1e-6)


def _constant_images(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).view(-1, 1, 1, 1).expand(-1, 1, 6, 6).contiguous()


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixup_and_cutmix_targets_and_loss_by_hand(kind):
    values = [10.0, 20.0, 40.0, 80.0, 160.0]
    labels = torch.tensor([1, 2, 0, IGNORE_LABEL, 3])  # the 4th is a padding duplicate
    data = DataConfig(num_classes=4, mixup_alpha=0.4 if kind == "mixup" else 0.0,
                      cutmix_alpha=1.0 if kind == "cutmix" else 0.0)  # fmt: skip
    criterion = Criterion(4, 0.0, build_mixing(data))
    torch.manual_seed(3)
    mixed, targets = criterion.mix(_constant_images(values), labels)
    v = torch.tensor(values)
    if kind == "mixup":  # mixed_i = lam * x_i + (1 - lam) * x_{i-1}
        lam = float((mixed[1, 0, 0, 0] - v[0]) / (v[1] - v[0]))
    else:  # a box of x_{i-1} pasted into x_i: lam is the share of x_i's own pixels
        lam = float((mixed[1] == v[1]).float().mean())
    onehot = F.one_hot(labels.clamp(min=0), 4).float()
    expected = lam * onehot + (1 - lam) * onehot.roll(1, 0)
    expected[3] = 0  # the padding row counts for nothing
    expected[4] = lam * onehot[4]  # its partner (the padding row) gives it nothing either
    assert torch.allclose(targets, expected, atol=1e-6)
    logits = torch.randn(5, 4)
    hand = -(expected * logits.log_softmax(1)).sum()
    assert torch.allclose(criterion.loss_sum(logits, targets), hand, atol=1e-5)


def test_weight_decay_groups_put_norms_and_biases_where_the_keys_say():
    model = build_model(ConvNetModel(), DataConfig())  # conv, BN, linear
    groups = param_groups(OptimConfig(weight_decay=0.1, norm_weight_decay=0.0,
                                      bias_weight_decay=0.05), model)  # fmt: skip
    by_wd = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    bn = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert by_wd[0.0] == {id(p) for m in bn for p in m.parameters()}
    assert by_wd[0.05] == {id(m.bias) for m in [*convs, model.fc]}
    assert by_wd[0.1] == {id(m.weight) for m in [*convs, model.fc]}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    same = param_groups(OptimConfig(weight_decay=0.1), model)
    assert [g["weight_decay"] for g in same] == [0.1]


def test_precision_auto_picks_bf16_only_where_measured_faster():
    from ddp_utils.config import ConvNetModel, GPTModel, ZooModel

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    for amx, avx in ((False, False), (True, False), (False, True), (True, True)):
        with (
            mock.patch("torch.cpu._is_amx_tile_supported", return_value=amx),
            mock.patch("torch.cpu._is_avx512_bf16_supported", return_value=avx),
        ):
            # The ConvNet and the GPT declare bf16_on_cpu (measured faster with AMX); ResNet not.
            assert resolve_precision("auto", cpu, ConvNetModel()) == ("bf16" if amx else "32")
            assert resolve_precision("auto", cpu, GPTModel()) == ("bf16" if amx else "32")
            assert resolve_precision("auto", cpu, ZooModel()) == "32"
            assert resolve_precision("auto", cpu) == "32"
            assert resolve_precision("32", cpu) == "32"
    for major, want in ((7, "fp16"), (8, "bf16"), (9, "bf16")):
        cuda = Cuda(usable=True, device_count=1, capability=(major, 0), name="GPU")
        assert resolve_precision("auto", gpu, GPTModel(), cuda) == want
        assert resolve_precision("fp16", gpu, cuda=cuda) == "fp16"
        assert resolve_precision("32", gpu, cuda=cuda) == "32"


def test_channels_last_auto_is_on_for_cuda_and_off_on_a_cpu():
    from helpers.runs import compose_config

    from ddp_utils.dist import Runtime
    from ddp_utils.train.state import resolve_auto

    cfg = compose_config()
    assert cfg.trainer.channels_last == "auto"
    cpu = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    gpu = Runtime(0, 0, 1, 1, torch.device("cuda", 0), "nccl")
    h100 = Cuda(usable=True, device_count=1, capability=(9, 0))
    with mock.patch("ddp_utils.train.precision.probe_cuda", return_value=h100):
        assert resolve_auto(cfg, cpu).trainer.channels_last == "false"
        assert resolve_auto(cfg, gpu).trainer.channels_last == "true"
    assert compose_config("trainer.channels_last=true").trainer.channels_last == "true"
    with pytest.raises(ConfigError, match="trainer.channels_last"):
        compose_config("trainer.channels_last=maybe")


def test_ema_decay_is_adjusted_and_copies_during_warmup():
    # The references: alpha = (1 - decay) * world_size * batch * ema_steps / epochs
    assert ema_decay(0.99998, 32, 1024, 600) == pytest.approx(1 - 0.00002 * 1024 * 32 / 600)
    assert ema_decay(0.9, 10, 1000, 1) == 0.0  # alpha capped at 1: a copy
    model = torch.nn.Linear(2, 2)
    ema = EMA(model, decay=0.5, every_steps=2)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model, step=1, in_warmup=False)  # not a multiple of every_steps: nothing
    assert not torch.equal(ema.module.weight, model.weight)
    ema.update(model, step=2, in_warmup=True)
    assert torch.equal(ema.module.weight, model.weight)  # the first update copies
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model, step=4, in_warmup=True)  # still warming up: a copy again
    assert torch.equal(ema.module.weight, model.weight)
    with torch.no_grad():
        model.weight.fill_(5.0)
    ema.update(model, step=6, in_warmup=False)  # the warm-up left nothing averaged: a copy
    assert torch.equal(ema.module.weight, model.weight)
    with torch.no_grad():
        model.weight.fill_(7.0)
    ema.update(model, step=8, in_warmup=False)
    assert torch.allclose(ema.module.weight, torch.full((2, 2), 6.0))  # 0.5 * 5 + 0.5 * 7


def test_callbacks_are_targets_and_bad_entries_are_named():
    built = build_callbacks([{"_target_": "ddp_utils.train.callbacks.Callback"}])
    assert len(built.callbacks) == 1
    with pytest.raises(ConfigError, match="each entry needs a _target_"):
        build_callbacks([{"every": 3}])
    with pytest.raises(ConfigError, match="is not a ddp_utils.train.callbacks.Callback"):
        build_callbacks([{"_target_": "collections.OrderedDict"}])


def test_imagenet_preset_composes_with_the_references_hyperparameters():
    cfg = compose_config("experiment=imagenet_resnet50", "data.root=/data/imagenet")
    d, o, s, t = cfg.data, cfg.optim, cfg.sched, cfg.trainer
    assert (cfg.model.name, cfg.model.arch, d.name, d.num_classes) == (
        "torchvision", "resnet50", "imagefolder", 1000)  # fmt: skip
    assert (d.train_crop_size, d.image_size, d.resize_size, d.batch_size) == (176, 224, 232, 128)
    assert (d.auto_augment, d.random_erase, d.mixup_alpha, d.cutmix_alpha) == (
        "ta_wide", 0.1, 0.2, 1.0)  # fmt: skip
    assert (o.name, o.lr, o.weight_decay, o.norm_weight_decay) == ("sgd", 0.5, 2e-5, 0.0)
    assert (s.name, s.warmup_epochs, t.epochs, t.label_smoothing) == ("cosine", 5, 600, 0.1)
    assert (t.ema_decay, t.ema_every_steps) == (0.99998, 32)
    assert math.isclose(s.warmup_start_factor, 0.01)


def test_no_module_of_the_package_reads_a_test_only_variable():
    offenders = [
        p.relative_to(ROOT) for p in (ROOT / "ddp_utils").rglob("*.py")
        if "DDP_RECIPES_" in p.read_text()
    ]  # fmt: skip
    assert offenders == []


def _probe(*overrides: str) -> None:
    from ddp_utils.evaluation import build_metrics
    from ddp_utils.tasks import build_task, check_task

    cfg = compose_config(*overrides)
    task = build_task(cfg)
    metrics = build_metrics(cfg.task, task, torch.device("cpu"))
    check_task(task, build_model(cfg.model, cfg.data), metrics, cfg, torch.device("cpu"))


def test_a_model_whose_output_does_not_fit_the_data_is_refused(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    named = ("model=custom", "model._target_=custom_models.NamedHead")
    _probe(*named)  # n_out's default, 10, is digits' class count
    for extra, shape in (("+model.n_out=3", "(2, 3)"), ("data.num_classes=3", "(2, 10)")):
        with pytest.raises(ConfigError) as e:
            _probe(*named, extra)
        text = str(e.value)
        assert f"has shape {shape}, but data.num_classes=" in text, text
        assert "custom_models.NamedHead (its parameters: in_channels=1, n_out=10" in text
    with pytest.raises(RuntimeError):  # a bug at every size keeps its own error and traceback
        _probe("model=custom", "model._target_=custom_models.Broken")


def test_torchvision_models_are_sized_for_the_data_or_name_the_size_they_need():
    _probe("model=torchvision", "model.arch=vit_b_32", "data.image_size=32")  # built for 32 px
    with pytest.raises(ConfigError) as e:
        _probe("model=torchvision", "model.arch=alexnet", "data.image_size=8")
    assert "model=torchvision model.arch=alexnet cannot take data.image_size=8 images" in str(
        e.value
    ) and "It runs at data.image_size=" in str(e.value)
