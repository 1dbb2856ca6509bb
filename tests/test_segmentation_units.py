"""Segmentation without processes: configs, the data path (folders, VOC, canvases, joint
transforms and their seeding), the task's loss and metrics, the models, the poly schedule."""

from __future__ import annotations

import pytest
import torch
from helpers.paths import MNIST_ROOT, ROOT, needs_mnist
from hydra import compose, initialize_config_dir
from PIL import Image
from segfolders import VAL_SIZES, write_seg_folder, write_voc
from torch.utils.data import DataLoader

from ddp_utils.config import ConfigError, SegFolderData, UserError, to_schema
from ddp_utils.data import IGNORE_LABEL, build_data
from ddp_utils.data.samplers import EpochTagged, ResumableDistributedSampler
from ddp_utils.data.segmentation import seg_dataset, seg_source
from ddp_utils.dist import Runtime
from ddp_utils.entry import register
from ddp_utils.models import build_model
from ddp_utils.tasks import Batch, build_task, check_task
from ddp_utils.tasks.segmentation import Segmentation

register()
RT = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
             backend="gloo")  # fmt: skip


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_schema(compose(config_name="train", overrides=list(overrides)))


def folder_cfg(root, **kw) -> SegFolderData:
    base = dict(root=str(root), num_classes=4, in_channels=3, base_size=24, crop_size=24,
                image_size=24, num_workers=0, batch_size=4, mean=[0.5] * 3, std=[0.25] * 3,
                augment=True)  # fmt: skip
    return SegFolderData(**(base | kw))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_seg_folder(tmp_path_factory.mktemp("segfolder"))


def test_the_recipes_compose_and_validate():
    cfg = compose_train("experiment=voc_deeplabv3")
    assert (cfg.model.arch, cfg.model.aux_loss, cfg.task.aux_weight) == (
        "deeplabv3_resnet50",
        True,
        0.5,
    )
    assert (cfg.optim.lr, cfg.data.batch_size, cfg.trainer.epochs, cfg.sched.name) == (
        0.02,
        4,
        30,
        "poly",
    )
    assert (cfg.data.base_size, cfg.data.crop_size, cfg.data.eval_size) == (520, 480, 520)
    cfg = compose_train("experiment=digits_segmentation")
    assert (cfg.data.name, cfg.model.name, cfg.task.monitor) == (
        "digits_seg",
        "seg_convnet_fullres",
        "miou",
    )
    assert cfg.data.image_size == cfg.data.crop_size
    # The small digits keep full resolution; MNIST's 28-pixel digits take the stride-2 default.
    assert (cfg.model.stem_stride, cfg.model.channels, cfg.model.context) == (1, [32, 64, 96], [2])
    cfg = compose_train("experiment=mnist_segmentation", "data.root=unused")
    assert (cfg.data.name, cfg.model.stem_stride, cfg.trainer.epochs) == ("mnist_seg", 2, 12)


@pytest.mark.parametrize("overrides,needle", [
    (("task=segmentation",), "task=segmentation needs image/mask data"),
    (("data=digits_seg",), "data=digits_seg holds masks: train it with task=segmentation"),
])  # fmt: skip
def test_data_and_task_must_pair(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        build_task(compose_train(*overrides))


def test_a_folder_scan_refuses_unmatched_pairs_sizes_and_colour_masks(tmp_path):
    root = write_seg_folder(tmp_path / "a", n_train=3, val_sizes=[(20, 20)])
    (root / "train" / "masks" / "001.png").unlink()
    Image.new("L", (5, 5)).save(root / "train" / "masks" / "extra.png")
    with pytest.raises(ConfigError) as e:
        seg_source(folder_cfg(root), "train", RT)
    assert "1 images without a mask" in str(e.value) and "001.png" in str(e.value)
    assert "1 masks without an image" in str(e.value) and "extra.png" in str(e.value)
    root = write_seg_folder(tmp_path / "b", n_train=3, val_sizes=[(20, 20)])
    Image.new("L", (7, 9)).save(root / "train" / "masks" / "002.png")
    with pytest.raises(ConfigError, match="002.png is 7x9, images/002.png 24x24"):
        seg_source(folder_cfg(root), "train", RT)
    Image.new("RGB", (20, 20)).save(root / "val" / "masks" / "000.png")
    with pytest.raises(
        ConfigError, match=r"hold colours, not class ids: masks/000.png \(mode RGB\)"
    ):
        seg_source(folder_cfg(root), "val", RT)


def test_a_mask_value_that_is_no_class_is_named_when_read(folder, tmp_path):
    with pytest.raises(ConfigError, match="classes.txt names 4 classes but data.num_classes=2"):
        seg_source(folder_cfg(folder, num_classes=2), "train", RT)
    root = write_seg_folder(tmp_path, n_train=2, val_sizes=[(20, 20)])
    (root / "classes.txt").unlink()
    cfg = folder_cfg(root, num_classes=2)  # the masks hold classes 0..3
    source = seg_source(cfg, "train", RT)
    with pytest.raises(UserError, match=r"the mask .*000.png holds the values \[[23]"):
        source[0]


def test_training_crops_pad_the_mask_with_ignored_and_are_seeded_per_sample(folder):
    cfg = folder_cfg(folder, scale_range=[0.5, 0.6])  # the image shrinks below the crop
    ds = seg_dataset(seg_source(cfg, "train", RT), cfg, True, seed=0)
    image, mask = ds[(0, 3)]
    assert image.shape == (3, 24, 24) and image.dtype == torch.uint8 and mask.dtype == torch.int64
    padded = mask == IGNORE_LABEL
    assert padded.float().mean() > 0.4  # the padding (and the border row) is ignored ...
    assert set(mask[~padded].unique().tolist()) <= {0, 1, 2, 3}  # ... the rest are classes
    again, other_epoch = ds[(0, 3)], ds[(1, 3)]
    assert torch.equal(again[0], image) and torch.equal(again[1], mask)
    assert not torch.equal(other_epoch[1], mask)
    dup_image, dup_mask = ds[(0, ~3)]  # a sampler's padding duplicate: the same pixels, ignored
    assert torch.equal(dup_image, image) and (dup_mask == IGNORE_LABEL).all()


def batches(ds, sampler, workers: int) -> list:
    loader = DataLoader(ds, batch_size=4, sampler=EpochTagged(sampler), num_workers=workers)
    return list(loader)


def test_augmentation_is_identical_at_any_num_workers_and_after_a_resume(folder):
    cfg = folder_cfg(folder)
    ds = seg_dataset(seg_source(cfg, "train", RT), cfg, True, seed=3)
    sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=3)
    sampler.set_epoch(2)
    at0, at2 = batches(ds, sampler, 0), batches(ds, sampler, 2)
    for (i0, m0), (i2, m2) in zip(at0, at2, strict=True):
        assert torch.equal(i0, i2) and torch.equal(m0, m2)
    sampler.set_epoch(2, start=4)  # resumed after one batch of 4
    for (i0, m0), (ir, mr) in zip(at0[1:], batches(ds, sampler, 0), strict=True):
        assert torch.equal(i0, ir) and torch.equal(m0, mr)


def test_evaluation_pads_every_image_to_the_split_largest_and_keeps_the_truth(folder):
    cfg = folder_cfg(folder)  # eval_size=null: each image at its own size
    source = seg_source(cfg, "val", RT)
    ds = seg_dataset(source, cfg, False, seed=0)
    canvas = (max(h for h, _ in VAL_SIZES), max(w for _, w in VAL_SIZES))
    for i, (h, w) in enumerate(VAL_SIZES):
        image, mask = ds[i]
        assert tuple(mask.shape) == canvas and tuple(image.shape[1:]) == canvas
        truth = source[i][1].long().masked_fill(source[i][1] == 255, IGNORE_LABEL)
        assert torch.equal(mask[:h, :w], truth)  # never resized
        assert (mask[h:] == IGNORE_LABEL).all() and (mask[:, w:] == IGNORE_LABEL).all()
        assert (image[:, h:] == 0).all()
    resized = seg_dataset(source, folder_cfg(folder, eval_size=12), False, seed=0)
    assert tuple(resized[0][1].shape) == (15, 17)  # 28x22 -> 15x12, 18x26 -> 12x17, ...


def test_voc_layout_reads_palette_indices_and_the_class_names(tmp_path):
    from ddp_utils.config import VOCData

    root = write_voc(tmp_path)
    cfg = VOCData(root=str(root), base_size=24, crop_size=24, image_size=24, num_workers=0,
                  batch_size=2, mean=[0.5] * 3, std=[0.25] * 3)  # fmt: skip
    source = seg_source(cfg, "val", RT)
    assert len(source) == 3 and source.classes[15] == "person"
    image, mask = source[0]
    assert image.shape[0] == 3 and mask.dtype == torch.uint8
    assert 255 in mask.unique() and mask[mask != 255].max() < 21  # indices, not colours
    data = build_data(cfg, RT, seed=0)
    images, masks = next(iter(data.train))
    assert images.shape == (2, 3, 24, 24) and masks.shape == (2, 24, 24)
    missing = "no Pascal VOC 2012 under data.root=.*never downloaded"
    with pytest.raises(ConfigError, match=missing) as e:
        seg_source(VOCData(root=str(tmp_path / "none")), "train", RT)
    assert "download=True" not in str(e.value)  # torchvision's hint: no option offers it


def test_predictions_are_drawn_as_ignored_over_the_padding():
    import numpy as np

    from ddp_utils.plot import shown_prediction

    truth = np.array([[0, 1, -100], [2, -100, -100]])  # a smaller image, padded right and down
    pred = np.array([[1, 1, 2], [2, 0, 1]])
    assert shown_prediction(truth, pred, 3).tolist() == [[1, 1, 3], [2, 3, 3]]


def test_digits_canvases_are_fixed_by_the_split_seed_and_hold_their_digits():
    cfg = compose_train("experiment=digits_segmentation").data
    a, b = seg_source(cfg, "val", RT), seg_source(cfg, "val", RT)
    assert torch.equal(a.images, b.images) and torch.equal(a.masks, b.masks)
    assert a.images.shape[1:] == (1, 32, 32) and len(a) == 359
    assert set(a.masks.unique().tolist()) == set(range(11))
    ink = a.images[:, 0] >= 64
    assert ((a.masks > 0) <= ink).all()  # a digit's pixel is ink
    assert a.classes[0] == "background" and a.classes[1] == "0"


@needs_mnist
def test_mnist_canvases_from_torchvision_layout():
    cfg = compose_train("data=mnist_seg", f"data.root={MNIST_ROOT}", "task=segmentation",
                        "model=seg_convnet").data  # fmt: skip
    val = seg_source(cfg, "val", RT)
    assert len(val) == 2000 and val.images.shape[1:] == (1, 64, 64)
    assert val.masks.max() <= 10


def test_the_loss_is_summed_over_counted_pixels_with_the_aux_head():
    task = Segmentation(num_classes=3, image_size=4, aux_weight=0.5)
    target = torch.tensor([[[0, 1, 2, IGNORE_LABEL]] * 4] * 2)
    logits = torch.randn(2, 3, 4, 4)
    aux = torch.randn(2, 3, 4, 4)
    model = lambda x: {"out": logits, "aux": aux}  # noqa: E731
    loss, count = task.train_loss(model, Batch(torch.zeros(2, 1, 4, 4), target))
    assert count == 24
    f = torch.nn.functional.cross_entropy
    expected = f(logits, target, reduction="sum") + 0.5 * f(aux, target, reduction="sum")
    assert torch.allclose(loss, expected)
    assert Batch(torch.zeros(2), torch.full((2, 4, 4), IGNORE_LABEL)).count() == 0  # padding


def test_samples_per_second_counts_epoch_positions_not_padding_duplicates():
    # 10 samples on 3 ranks in batches of 2: the last step's 2 padding duplicates are no
    # position of the epoch, so the samples trained are 10 (and 4 after a resume at 6).
    assert [ResumableDistributedSampler(10, 3, 0).consumed(b, 2) for b in (1, 2)] == [6, 10]
    resumed = ResumableDistributedSampler(10, 3, 0)
    resumed.set_epoch(0, start=6)
    assert resumed.consumed(1, 2) - 6 == 4


def test_mean_iou_leaves_out_a_class_absent_from_truth_and_prediction():
    from ddp_utils.evaluation import build_metrics

    cfg = compose_train("experiment=digits_segmentation")
    task = Segmentation(num_classes=3, image_size=4)
    metrics = build_metrics(cfg.task, task, torch.device("cpu"))
    target = torch.tensor([[[0, 0, 1, 1]]])
    metrics.update(torch.tensor([[[0, 1, 1, 1]]]), target)  # class 2 nowhere
    out = metrics.compute()
    assert torch.allclose(out["per_class_iou"], torch.tensor([0.5, 2 / 3, 0.0]))
    assert torch.isclose(out["miou"], torch.tensor((0.5 + 2 / 3) / 2))  # of classes 0 and 1
    assert torch.isclose(out["pixel_accuracy"], torch.tensor(0.75))


@pytest.mark.parametrize("arch,aux", [("lraspp_mobilenet_v3_large", False),
                                      ("fcn_resnet50", True)])  # fmt: skip
def test_torchvision_segmentation_models_build_for_the_data(arch, aux, tmp_path):
    import torchvision

    backbone = torchvision.models.get_model(
        arch.split("_", 1)[1] if arch.startswith("fcn") else "mobilenet_v3_large"
    )
    torch.save(backbone.state_dict(), tmp_path / "backbone.pt")
    cfg = compose_train("task=segmentation", "model=torchvision_seg", f"model.arch={arch}",
                        f"model.aux_loss={aux}", "data=digits_seg",
                        f"model.weights_backbone={tmp_path / 'backbone.pt'}")  # fmt: skip
    from ddp_utils.evaluation import build_metrics
    from ddp_utils.models import build_model

    task = build_task(cfg)
    model = build_model(cfg.model, cfg.data)
    check_task(task, model, build_metrics(cfg.task, task, RT.device), cfg, RT.device)
    out = model.eval()(torch.zeros(2, 1, 32, 32))
    assert out["out"].shape == (2, 11, 32, 32) and ("aux" in out) == aux
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first.in_channels == 1
    loaded = dict(backbone.named_parameters())  # a deeper layer than the adapted stem
    name, value = list(model.backbone.named_parameters())[-1]
    assert torch.equal(value, loaded.get(name, loaded.get(f"features.{name}")))


def test_a_head_for_another_class_count_is_refused_before_training():
    from ddp_utils.evaluation import build_metrics
    from ddp_utils.models import build_model

    cfg = compose_train("experiment=digits_segmentation")
    task = build_task(cfg)
    model = build_model(cfg.model, cfg.data, num_outputs=5)
    with pytest.raises(ConfigError, match=r"has shape \(2, 5, 32, 32\).*needs \(2, 11, 32, 32\)"):
        check_task(task, model, build_metrics(cfg.task, task, RT.device), cfg, RT.device)


def test_poly_decays_to_zero_as_the_references():
    from ddp_utils.optim import lr_factor

    cfg = compose_train("sched=poly").sched
    assert lr_factor(cfg, 0, 100, 10, 0.1) == 1.0
    assert lr_factor(cfg, 50, 100, 10, 0.1) == pytest.approx(0.5**0.9)
    assert lr_factor(cfg, 100, 100, 10, 0.1) == 0.0


def test_the_training_crop_is_the_window_of_the_resized_image(folder):
    # Scale 1 (base = the shorter side), no flip: the crop is a plain window of the source.
    cfg = folder_cfg(folder, base_size=24, crop_size=16, scale_range=[1.0, 1.0], hflip=False)
    source = seg_source(cfg, "train", RT)
    ds = seg_dataset(source, cfg, True, seed=0)
    image, mask = ds[(0, 1)]
    assert window_of(source[1], image, mask, flipped=False)
    # With data.hflip, some samples are mirrored windows, none is both or neither.
    flips = seg_dataset(source, folder_cfg(folder, base_size=24, crop_size=16,
                                           scale_range=[1.0, 1.0]), True, seed=0)  # fmt: skip
    found = []
    for i in range(len(source)):
        image, mask = flips[(0, i)]
        plain, mirrored = (window_of(source[i], image, mask, f) for f in (False, True))
        assert plain != mirrored
        found.append(mirrored)
    assert any(found) and not all(found)


def window_of(pair, image, mask, flipped: bool) -> bool:
    """Whether ``image`` and ``mask`` are one 16x16 window of the source ``pair``."""
    src_image, src_mask = pair
    src = src_mask.long().masked_fill(src_mask == 255, IGNORE_LABEL)
    if flipped:
        image, mask = image.flip(-1), mask.flip(-1)
    hits = [(y, x) for y in range(9) for x in range(9)
            if torch.equal(src_image[:, y:y + 16, x:x + 16], image)]  # fmt: skip
    return len(hits) == 1 and torch.equal(src[hits[0][0] : hits[0][0] + 16,
                                              hits[0][1] : hits[0][1] + 16], mask)  # fmt: skip


@pytest.mark.parametrize("overrides,needle", [
    (("data.loader=tensor",), "makes its batches through DataLoader workers"),
    (("data.canvas_size=20",), r"a 8-pixel digit scaled by data.digit_scales=\[2, 3\] is 24"),
])  # fmt: skip
def test_canvas_mistakes_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        cfg = compose_train("experiment=digits_segmentation", *overrides)
        seg_source(cfg.data, "train", RT)


def test_a_head_without_aux_refuses_model_aux_loss():
    from ddp_utils.models import build_model

    cfg = compose_train("experiment=digits_segmentation", "model=torchvision_seg",
                        "model.arch=lraspp_mobilenet_v3_large", "model.aux_loss=true")  # fmt: skip
    with pytest.raises(ConfigError, match="lraspp_mobilenet_v3_large with model.aux_loss=True"):
        build_model(cfg.model, cfg.data)


@pytest.mark.parametrize("target,error", [
    ("custom_models.DictSegNet", None),
    ("ddp_utils.models.nets.SegConvNet", None),  # a plain tensor
    ("custom_models.PooledSegNet", r"has shape \(2, 11, 16, 16\).*needs \(2, 11, 32, 32\)"),
])  # fmt: skip
def test_a_custom_segmentation_model_returns_a_tensor_or_a_dict_with_out(target, error):
    from ddp_utils.evaluation import build_metrics
    from ddp_utils.models import build_model

    cfg = compose_train("experiment=digits_segmentation", "model=custom",
                        f"model._target_={target}")  # fmt: skip
    task = build_task(cfg)
    model = build_model(cfg.model, cfg.data)
    metrics = build_metrics(cfg.task, task, RT.device)
    if error:
        with pytest.raises(ConfigError, match=error):
            check_task(task, model, metrics, cfg, RT.device)
        return
    check_task(task, model, metrics, cfg, RT.device)
    target_mask = torch.randint(0, 11, (2, 32, 32))
    loss, count = task.train_loss(model, Batch(torch.randn(2, 1, 32, 32), target_mask))
    assert count == 2 * 32 * 32 and loss.requires_grad


def test_a_folder_is_scanned_once_then_its_index_is_read_from_the_cache(tmp_path, monkeypatch):
    from ddp_utils.data.segmentation import folders

    root = write_seg_folder(tmp_path, n_train=3, val_sizes=[(20, 20)])
    scans = []
    real = folders.scan_pairs
    monkeypatch.setattr(folders, "scan_pairs", lambda *a: scans.append(a) or real(*a))
    first = seg_source(folder_cfg(root), "train", RT)
    again = seg_source(folder_cfg(root), "train", RT)
    assert len(scans) == 1 and (root / ".ddp_recipes_cache" / "segfolder-train.pt").is_file()
    assert torch.equal(first.sizes, again.sizes) and len(again) == 3
    Image.new("L", (24, 24)).save(root / "train" / "masks" / "003.png")  # a change: rescanned
    with pytest.raises(ConfigError, match="1 masks without an image"):
        seg_source(folder_cfg(root), "train", RT)


def receptive_extent(model: torch.nn.Module, size: int = 96) -> int:
    """The side of the square of input pixels that the class scores at the centre pixel
    depend on (their gradient is non-zero there)."""
    model.eval()
    x = torch.randn(1, 1, size, size, requires_grad=True)
    model(x)[0, :, size // 2, size // 2].sum().backward()
    rows, cols = x.grad[0, 0].abs().gt(0).nonzero(as_tuple=True)
    return int(min(rows.max() - rows.min(), cols.max() - cols.min())) + 1


def test_the_segmentation_model_sees_a_whole_28_pixel_digit_and_more():
    """Item 11: a pixel's class comes from the whole digit around it. The former three
    full-resolution stages saw 23 pixels, so a 28-pixel digit's class flipped along it."""
    cfg = compose_train("experiment=mnist_segmentation", "data.root=unused")
    model = build_model(cfg.model, cfg.data)
    assert receptive_extent(model) >= 2 * 28, "the context must hold a digit on either side"
    assert receptive_extent(type(model)(1, 11, context=[])) >= 28 * 3 // 2
    out = model(torch.randn(2, 1, 40, 56))  # sides that do not divide by 16
    assert out.shape == (2, 11, 40, 56)
