"""The streamed data path in one process: folder layout errors, decoding, seeded transforms."""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.paths import ROOT
from hydra import compose, initialize_config_dir
from imagefolders import write_digits_folder
from PIL import Image
from torch.utils.data import DataLoader

from ddp_utils.config import ConfigError, CustomData, ImageFolderData, to_schema
from ddp_utils.data import build_data, build_eval_data
from ddp_utils.data.images.imagefolder import BadImageError, ImageFolderSource, decode, load_index
from ddp_utils.data.images.transforms import SeededTransform, train_transform
from ddp_utils.data.loaders import default_num_workers
from ddp_utils.data.samplers import EpochTagged, ResumableDistributedSampler
from ddp_utils.dist import Runtime
from ddp_utils.entry import register
from ddp_utils.train.state import Training

RT = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
register()


def folder_cfg(root, **kw) -> ImageFolderData:
    base = dict(root=str(root), in_channels=1, image_size=8, resize_size=8,
                mean=[0.3], std=[0.38], num_workers=0)  # fmt: skip
    return ImageFolderData(**{**base, **kw})


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    return write_digits_folder(tmp_path_factory.mktemp("small"), limit=60)


@pytest.fixture
def folder(small_folder, tmp_path):
    copy = tmp_path / "f"
    shutil.copytree(small_folder, copy, ignore=shutil.ignore_patterns(".ddp_recipes_cache"))
    return copy


def test_build_data_streams_uint8_batches_with_class_names(folder):
    data = build_data(folder_cfg(folder, batch_size=16), RT, seed=0)
    assert data.classes == [str(i) for i in range(10)]
    images, labels = next(iter(data.train))
    assert images.dtype == torch.uint8 and images.shape == (16, 1, 8, 8)
    assert labels.dtype == torch.long and int(labels.min()) >= 0 and int(labels.max()) <= 9
    assert sum(len(b[1]) for b in data.val) == len(data.val.dataset) == 60


def test_close_stops_the_persistent_workers_and_a_new_epoch_restarts_them(folder):
    data = build_data(folder_cfg(folder, batch_size=16, num_workers=1), RT, seed=0)
    first = [labels for _, labels in data.train]
    workers = data.train._iterator._workers
    assert all(w.is_alive() for w in workers)
    data.close()
    assert data.train._iterator is None and not any(w.is_alive() for w in workers)
    again = [labels for _, labels in data.train]  # same epoch: the same batches
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    data.close()


def _fail(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_data(cfg, RT, seed=0)


def test_layout_mistakes_name_the_path_and_the_fix(folder, tmp_path):
    _fail(folder_cfg(tmp_path / "nowhere"), r"data.root=.*nowhere does not exist")
    _fail(folder_cfg(folder, train_dir="training"), r"data.train_dir: the folder .*training")
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    _fail(folder_cfg(empty), r"has no class folders")
    (folder / "train" / "10").mkdir()
    (folder / "train" / "10" / "notes.txt").write_text("not an image")
    _fail(folder_cfg(folder), r"class folder .*train/10 holds no images")
    shutil.rmtree(folder / "train" / "10")
    (folder / "val" / "9").rename(folder / "val" / "nine")
    _fail(folder_cfg(folder), r"only in train/: \['9'\]; only in val/: \['nine'\]")
    (folder / "val" / "nine").rename(folder / "val" / "9")
    _fail(folder_cfg(folder, num_classes=5), r"10 class folders but data.num_classes=5")


def test_index_is_cached_and_rebuilt_when_a_class_folder_changes(folder):
    cfg = folder_cfg(folder)
    first = load_index(cfg, "train", RT)
    cache = folder / ".ddp_recipes_cache" / "imagefolder-train.pt"
    assert cache.is_file() and len(first.labels) == 60
    extra = folder / "train" / "0" / "extra.PNG"  # upper case counts too
    shutil.copy(next((folder / "train" / "0").iterdir()), extra)
    again = load_index(cfg, "train", RT)
    assert len(again.labels) == 61 and "0/extra.PNG" in [again.paths[i] for i in range(61)]
    assert int(again.sizes.sum()) == sum(p.stat().st_size for p in (folder / "train").rglob("*.*"))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP"])
def test_common_formats_decode_as_grey_or_rgb(tmp_path, fmt):
    rgb = (np.arange(12 * 10 * 3) % 251).astype("uint8").reshape(12, 10, 3)
    path = tmp_path / f"x.{fmt.lower()}"
    Image.fromarray(rgb).save(path, fmt)
    assert decode(str(path), 3).shape == (3, 12, 10)
    assert decode(str(path), 1).shape == (1, 12, 10)


def test_unreadable_image_error_names_the_file_even_from_a_worker(folder):
    bad = next((folder / "train" / "4").iterdir())
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 10)
    cfg = folder_cfg(folder)
    source = ImageFolderSource(load_index(cfg, "train", RT), cfg)
    i = [source.index.paths[k] for k in range(len(source))].index(f"4/{bad.name}")
    with pytest.raises(BadImageError, match=f"cannot read the image {bad}"):
        source[i]
    loader = DataLoader(source, batch_size=len(source), num_workers=1)
    with pytest.raises(BadImageError) as e:
        next(iter(loader))
    assert str(e.value).startswith(f"cannot read the image {bad}")  # no worker traceback
    skipping = ImageFolderSource(source.index, folder_cfg(folder, skip_bad_images=True))
    image, label = skipping[i]
    assert label == -101 and image.shape == (1, 8, 8)


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    images = torch.arange(64 * 3 * 20 * 20).remainder(256).to(torch.uint8).view(64, 3, 20, 20)
    source = list(zip(images, range(64), strict=True))
    cfg = ImageFolderData(in_channels=3, image_size=12, augment=True, mean=[0.5] * 3,
                          std=[0.5] * 3)  # fmt: skip
    ds = SeededTransform(source, train_transform(cfg), seed=7)
    assert torch.equal(ds[(3, 5)][0], ds[(3, 5)][0])
    assert ds[(3, 5)][0].shape == (3, 12, 12)
    draws = {ds[(e, 5)][0].numpy().tobytes() for e in range(6)}
    assert len(draws) > 1  # other epochs, other crops
    other_seed = SeededTransform(source, train_transform(cfg), seed=8)
    assert any(not torch.equal(ds[(0, i)][0], other_seed[(0, i)][0]) for i in range(8))
    # A padding duplicate is the same sample with its label ignored.
    assert torch.equal(ds[(3, ~5)][0], ds[(3, 5)][0]) and ds[(3, ~5)][1] == -100
    # Workers, order and the caller's RNG play no part.
    sampler = ResumableDistributedSampler(64, 2, 1, seed=1)
    sampler.set_epoch(3)
    batches = [
        torch.cat([b[0] for b in DataLoader(ds, 8, sampler=EpochTagged(sampler), num_workers=w)])
        for w in (0, 2)
    ]
    assert torch.equal(*batches)
    state = torch.get_rng_state()
    ds[(0, 0)]
    assert torch.equal(torch.get_rng_state(), state)


def test_auto_workers_share_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(32)))
    assert default_num_workers(1) == 16 and default_num_workers(4) == 7
    assert default_num_workers(8) == 3 and default_num_workers(64) == 1


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def test_plus_arguments_go_to_a_custom_target_and_are_refused_elsewhere():
    cfg = to_schema(compose_train("data=custom", "data._target_=m.f", "+data.limit=5"))
    assert cfg.data.kwargs == {"limit": 5} and cfg.data._target_ == "m.f"
    with pytest.raises(ConfigError, match="data.limit is not a key of data=digits"):
        to_schema(compose_train("+data.limit=5"))
    with pytest.raises(ConfigError, match="data=custom needs data._target_"):
        to_schema(compose_train("data=custom"))
    with pytest.raises(ConfigError, match="data.in_channels=2"):
        to_schema(compose_train("data=imagefolder", "data.in_channels=2", "data.mean=[0,0]",
                                "data.std=[1,1]"))  # fmt: skip


def test_custom_target_errors_are_one_paragraph(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    base = dict(in_channels=1, image_size=8, mean=[0.3], std=[0.38])
    with pytest.raises(ConfigError, match="data._target_=no.such.fn could not be called"):
        build_data(CustomData(**base, _target_="no.such.fn"), RT, seed=0)
    with pytest.raises(ConfigError, match="could not be called with {'nope': 1}"):
        build_data(CustomData(**base, _target_="imagefolders.digits_datasets",
                              kwargs={"nope": 1}), RT, seed=0)  # fmt: skip
    loader, _, classes, _ = build_eval_data(
        CustomData(**base, _target_="imagefolders.digits_datasets", kwargs={"limit": 20},
                   resize_size=8, num_workers=0), RT, seed=0,
    )  # fmt: skip
    images, labels = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape[1:] == (1, 8, 8)
    assert classes == [str(i) for i in range(10)]


def test_recipe_transforms_join_the_training_preset_and_stay_seeded():
    cfg = ImageFolderData(
        in_channels=3,
        image_size=12,
        train_crop_size=10,
        augment=True,
        auto_augment="ta_wide",
        random_erase=0.5,
        mean=[0.5] * 3,
        std=[0.5] * 3,
    )
    steps = train_transform(cfg).transforms
    assert [type(t).__name__ for t in steps] == ["CropFlip", "TrivialAugmentWide",
                                                 "RandomErasing"]  # fmt: skip
    assert steps[0].crop.size == (10, 10)  # RandomResizedCrop(train_crop_size) + flip
    images = torch.arange(8 * 3 * 20 * 20).remainder(256).to(torch.uint8).view(8, 3, 20, 20)
    ds = SeededTransform(list(zip(images, range(8), strict=True)), train_transform(cfg), seed=1)
    assert ds[(2, 3)][0].shape == (3, 10, 10) and torch.equal(ds[(2, 3)][0], ds[(2, 3)][0])
    # The in-memory sets are augmented on the device: their schema has no per-sample presets.
    with pytest.raises(ConfigError, match="data.auto_augment is not a key of data=digits: it "
                       "belongs to data=imagefolder | custom"):  # fmt: skip
        to_schema(compose_train("+data.auto_augment=ra"))


def _touch(path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_scan_follows_each_folder_once_and_skips_loops(tmp_path):
    import logging

    from ddp_utils.data.images.imagefolder import class_folders, scan

    root, outside = tmp_path / "root", tmp_path / "outside"
    train = root / "train"
    for name in ("coffee/a.png", "coffee/b.png", "coffee/sub/c.png", "chelsea/d.png"):
        _touch(train / name)
    _touch(root / "val" / "coffee" / "v.png")
    _touch(outside / "e.png", b"outside")
    links = {
        "coffee/up": "..", "coffee/self": ".", "chelsea/loopy": "../../train",  # loops
        "chelsea/cross": "../coffee/sub",  # another class's folder: its images stay there
        "chelsea/twice.png": "../coffee/a.png",  # a file of another class, reached twice
        "coffee/ext": str(outside),  # out of data.root: followed, with a warning
        "coffee/ext_again": str(outside),  # the same folder through a second link
        "coffee/leak": "../../val/coffee",  # into the val split
        "coffee/gone.png": "nowhere.png",  # broken
    }  # fmt: skip
    for name, target in links.items():
        (train / name).symlink_to(target)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("ddp_recipes")
    logger.addHandler(handler)
    try:
        index = scan(train, class_folders(train, "data.train_dir"))
    finally:
        logger.removeHandler(handler)
    found = {index.paths[i]: index.classes[int(index.labels[i])] for i in range(len(index.labels))}
    assert found == {
        "chelsea/d.png": "chelsea", "coffee/a.png": "coffee", "coffee/b.png": "coffee",
        "coffee/sub/c.png": "coffee", "coffee/ext/e.png": "coffee",
    }  # fmt: skip
    assert index.sizes.tolist()[index.classes.index("coffee") :][-1] == len(b"outside")
    text = "\n".join(messages)
    for name in ("coffee/up", "coffee/self", "chelsea/loopy"):
        assert f"skipping the link {train / name} -> " in text and "a loop" in text
    assert f"skipping the link {train / 'chelsea/cross'}" in text
    assert f"skipping the link {train / 'coffee/ext_again'}" in text
    assert f"skipping the link {train / 'coffee/leak'}" in text and "another split" in text
    assert f"following the link {train / 'coffee/ext'} out of data.root" in text
    assert f"skipping {train / 'coffee/gone.png'}" in text
    assert "1 files reached twice" in text


# Values 0, 257 * 128 and 65535 of 16 bits are 0, 128 and 255 of 8.
WIDE = np.array([[0, 257 * 128], [65535, 65535]], dtype=np.uint16)


@pytest.mark.parametrize("layout", ["I;16 by PIL", "grey", "grey+alpha", "RGB", "RGBA"])
def test_16_bit_pngs_are_scaled_to_8_bits(tmp_path, layout):
    from imagefolders import write_png16

    path = tmp_path / "wide.png"
    if layout == "I;16 by PIL":
        Image.fromarray(WIDE).save(path)
        assert Image.open(path).mode == "I;16"
    else:
        channels = {"grey": 1, "grey+alpha": 2, "RGB": 3, "RGBA": 4}[layout]
        write_png16(path, np.stack([WIDE] * channels, -1) if channels > 1 else WIDE)
    for channels in (1, 3):
        image = decode(str(path), channels)
        assert image.dtype == torch.uint8 and image.shape == (channels, 2, 2)
        assert image[0].tolist() == [[0, 128], [255, 255]]


def test_a_16_bit_png_among_8_bit_ones_batches(tmp_path):
    from imagefolders import write_png16

    from ddp_utils.data.images.transforms import eval_transform

    folder = write_digits_folder(tmp_path / "f", limit=20)
    write_png16(folder / "train" / "3" / "wide.png", np.full((8, 8), 40000, dtype=np.uint16))
    cfg = folder_cfg(folder)
    ds = SeededTransform(ImageFolderSource(load_index(cfg, "train", RT), cfg),
                         eval_transform(cfg), seed=0)  # fmt: skip
    images, labels = next(iter(DataLoader(ds, batch_size=len(ds), num_workers=0)))
    assert images.dtype == torch.uint8 and len(labels) == len(ds)
    assert round(40000 * 255 / 65535) in images.flatten().tolist()


@pytest.mark.parametrize(
    "array, expected",
    [
        (WIDE.astype(np.int32), [[0, 128], [255, 255]]),  # mode I: 16-bit data in 32 bits
        (np.array([[0.0, 0.5], [1.0, 1.0]], dtype=np.float32), [[0, 128], [255, 255]]),  # F
    ],
)
def test_pil_images_of_wide_modes_are_scaled(array, expected):
    from ddp_utils.data.images.imagefolder import pil_to_uint8

    image = pil_to_uint8(Image.fromarray(array), 1, "item")
    assert image.dtype == torch.uint8 and image[0].tolist() == expected
    assert pil_to_uint8(Image.fromarray(array), 3, "item").shape == (3, 2, 2)


def test_images_out_of_range_are_refused_naming_them_or_skipped():
    from ddp_utils.data.images.custom import CustomSource

    items = [
        (Image.fromarray(np.full((8, 8), 7.5, dtype=np.float32)), 1),  # mode F beyond [0, 1]
        (Image.fromarray(np.full((8, 8), 70000, dtype=np.int32)), 2),  # mode I beyond 16 bits
        (torch.full((8, 8), 300, dtype=torch.int32), 3),  # an int tensor beyond 8 bits
        (torch.full((8, 8), 0.25), 4),  # fine
    ]
    cfg = CustomData(_target_="pkg.make", in_channels=1, image_size=8)
    source = CustomSource(items, cfg, "train")
    for i, what in enumerate(["mode F", "mode I", "dtype int32"]):
        with pytest.raises(BadImageError, match=f"item {i}.*{what}.*data.skip_bad_images=true"):
            source[i]
    skipping = CustomSource(items, CustomData(**{**cfg.__dict__, "skip_bad_images": True}), "train")
    assert [skipping[i][1] for i in range(4)] == [-101, -101, -101, 4]
    assert skipping[3][0].unique().tolist() == [64]


def test_the_end_of_training_stops_the_loaders_workers(folder):
    data = build_data(folder_cfg(folder, batch_size=16, num_workers=1), RT, seed=0)
    next(iter(data.train)), next(iter(data.val))
    workers = data.train._iterator._workers + data.val._iterator._workers
    names = ("stop", "watchdog", "progress", "trackers", "checkpointer")
    helpers = {name: mock.Mock() for name in names}
    Training.close(SimpleNamespace(data=data, **helpers), drain=False)
    assert not any(w.is_alive() for w in workers)
    helpers["stop"].close.assert_called_once_with(False)
    helpers["checkpointer"].close.assert_called_once_with(drain=False)


def test_a_data_family_outside_the_package_is_built_from_its_schema_alone():
    """A new family is its module and its schema (which names the module): build_data,
    build_eval_data, resolve_data and offered_by_data call it with no edit to the package."""
    from ramp_family import RampData

    from ddp_utils.data import offered_by_data, resolve_data

    cfg = resolve_data(RampData(batch_size=4), RT)
    assert cfg.resolved
    assert offered_by_data(cfg) == cfg.sizes() | {"ramp_length": 30}
    shards = []
    for rank in range(3):
        rt = Runtime(rank, rank, 3, 3, torch.device("cpu"), "gloo")
        bundle = build_data(cfg, rt, seed=0)
        for loader, seen in ((bundle.train, []), (bundle.val, shards)):
            for images, labels in loader:
                seen += [
                    int(v) for v, lab in zip(images[:, 0, 0, 0], labels, strict=True) if lab >= 0
                ]
        loader, preprocess, classes, _ = build_eval_data(cfg, rt, seed=0)
        assert classes is None and len(loader.sampler) in (3, 4)
    assert sorted(shards) == list(range(100, 111))  # every validation sample exactly once


def test_a_family_module_without_its_builders_is_named(monkeypatch):
    from ramp_family import RampData

    monkeypatch.setattr(RampData, "family", "ddp_utils.data.cache")  # a module, not a family
    with pytest.raises(ConfigError, match=r"ddp_utils.data.cache lacks build, build_eval"):
        build_data(RampData(), RT, seed=0)
    monkeypatch.setattr(RampData, "family", "no_such_family_module")
    with pytest.raises(ConfigError, match=r"no_such_family_module could not be imported"):
        build_data(RampData(), RT, seed=0)


@pytest.mark.parametrize("size", [(28, 28), (5, 200), (200, 5), (40, 33), (1, 1)])
def test_the_one_step_crop_and_flip_draws_and_makes_v2s_pixels(size):
    """``CropFlip`` against v2's RandomResizedCrop + RandomHorizontalFlip: the same images and
    the same RNG state after (extreme aspect ratios take v2's central fallback crop)."""
    from torchvision.transforms import v2

    from ddp_utils.data.images.transforms import CropFlip

    mode = v2.InterpolationMode.BILINEAR
    ref = v2.Compose([v2.RandomResizedCrop(32, interpolation=mode, antialias=True),
                      v2.RandomHorizontalFlip()])  # fmt: skip
    fast = CropFlip(32, mode)
    for seed in range(200):
        image = torch.randint(0, 256, (3, *size), dtype=torch.uint8)
        torch.manual_seed(seed)
        want, after = ref(image), torch.rand(1)
        torch.manual_seed(seed)
        assert torch.equal(fast(image), want) and torch.equal(torch.rand(1), after), seed


@pytest.mark.parametrize("size", [(28, 28), (5, 200), (40, 33), (32, 32), (300, 260)])
@pytest.mark.parametrize("channels", [1, 3])
def test_the_seeded_crop_and_flip_is_v2s_crop_at_the_seeds_draws(size, channels):
    """``CropFlip.seeded``: the box ``crop_box`` draws from ``random.Random(seed)``, resized
    by v2's kernel (pixel for pixel), flipped on the seed's next draw; torch's generator is
    left alone, and the sample's seed alone decides."""
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    from ddp_utils.data.images.transforms import CropFlip, SeedDraws

    fast = CropFlip(32, v2.InterpolationMode.BILINEAR)
    images = torch.randint(0, 256, (100, channels, *size), dtype=torch.uint8)
    before = torch.random.get_rng_state()
    boxes = set()
    for seed, image in enumerate(images):
        draws = SeedDraws(seed)
        top, left, h, w = fast.crop_box(*size, draws)
        want = F.resized_crop_image(image, top, left, h, w, [32, 32], antialias=True)
        if draws.random() < 0.5:
            want = F.horizontal_flip_image(want)
        got = fast.seeded(image, seed)
        assert torch.equal(got, want) and torch.equal(fast.seeded(image, seed), got), seed
        boxes.add((top, left, h, w))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert len(boxes) > 50 or min(size) < 10  # the seeds draw different crops (5 x 200: central)
