"""data=voc_det: Pascal VOC's detection layout. The same scenes written as a VOC folder and
as a COCO folder give the same boxes (VOC's 1-based inclusive pixels read right); difficult
objects are crowd boxes; every malformed file is refused naming the file and the object; a VOC
folder trains at world size 2 and evaluates at world size 3 to training's last mAP."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from detfolders import CLASSES, write_coco_folder, write_voc_folder
from helpers.launch import run_forked, run_ranks
from helpers.runs import read_metrics

from ddp_utils.config import ConfigError, DetFolderData, VOCDetData
from ddp_utils.data.detection.coco import CocoSource
from ddp_utils.data.detection.voc import VOCSource

OURS = ["data=voc_det", f"data.classes=[{','.join(CLASSES)}]", "data.num_classes=3"]


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return write_voc_folder(tmp_path_factory.mktemp("voc"))


def voc_cfg(root, **kw) -> VOCDetData:
    return VOCDetData(root=str(root), classes=list(CLASSES), num_classes=3, **kw)


def test_voc_boxes_equal_the_same_scenes_coco_boxes(voc, tmp_path):
    coco = write_coco_folder(tmp_path / "coco")
    for split in ("train", "val"):
        ours = VOCSource(voc_cfg(voc), split)
        theirs = CocoSource(DetFolderData(root=str(coco), num_classes=3), split)
        assert len(ours) == len(theirs) and ours.classes == ["background", *CLASSES]
        for i in range(len(ours)):
            (image, target), (png, expected) = ours[i], theirs[i]
            assert image.shape == png.shape and image.dtype == torch.uint8
            for key in ("boxes", "labels", "iscrowd"):
                assert torch.equal(target[key], expected[key]), (split, i, key)
            assert target["boxes"].canvas_size == expected["boxes"].canvas_size


def annotation(voc, key="val_000"):
    return voc / "VOCdevkit" / "VOC2012" / "Annotations" / f"{key}.xml"


def edited(voc, tmp_path, edit):
    """A copy of the folder with ``edit(folder, first annotation)`` applied."""
    folder = tmp_path / "edited"
    shutil.copytree(voc, folder)
    edit(folder, annotation(folder))
    return folder


def first_object(xml_text: str, replacement: str) -> str:
    start, end = xml_text.index("<object>"), xml_text.index("</object>") + len("</object>")
    return xml_text[:start] + replacement + xml_text[end:]


def set_first_object(replacement: str):
    return lambda folder, xml: xml.write_text(first_object(xml.read_text(), replacement))


BOX = "<bndbox><xmin>{}</xmin><ymin>{}</ymin><xmax>{}</xmax><ymax>{}</ymax></bndbox>"
CASES = {
    "outside": (
        set_first_object(f"<object><name>red</name>{BOX.format(50, 40, 90, 80)}</object>"),
        "outside its",
    ),  # fmt: skip
    "zero area": (
        set_first_object(f"<object><name>red</name>{BOX.format(9, 5, 8, 20)}</object>"),
        "zero area",
    ),  # fmt: skip
    "class": (
        set_first_object(f"<object><name>blue</name>{BOX.format(1, 1, 5, 5)}</object>"),
        "has class 'blue', not one of data.classes",
    ),  # fmt: skip
    "bndbox": (
        set_first_object("<object><name>red</name><bndbox><xmin>1</xmin></bndbox></object>"),
        "A bndbox holds numbers",
    ),  # fmt: skip
    "not xml": (lambda folder, xml: xml.write_text("<annotation><size>"), "is not XML"),
    "no annotation": (lambda folder, xml: xml.unlink(), "does not exist, but its image set"),
    "no image": (
        lambda folder, xml: (xml.parent.parent / "JPEGImages" / f"{xml.stem}.jpg").unlink(),
        "which does not exist",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_voc_file_is_refused_naming_the_file_and_the_fix(voc, tmp_path, case):
    edit, message = CASES[case]
    folder = edited(voc, tmp_path, edit)
    assert "<object>" in annotation(voc).read_text()  # the case edits a box, not the scene
    with pytest.raises(ConfigError) as caught:
        VOCSource(voc_cfg(folder), "val")
    assert message in str(caught.value) and str(annotation(folder)) in str(caught.value)


def test_difficult_objects_are_crowd_boxes_or_dropped(voc, tmp_path):
    def difficult(folder, xml):
        xml.write_text(xml.read_text().replace("<difficult>0</difficult>",
                                               "<difficult>1</difficult>", 1))  # fmt: skip

    folder = edited(voc, tmp_path, difficult)
    kept = VOCSource(voc_cfg(folder), "val")[0][1]
    dropped = VOCSource(voc_cfg(folder, keep_difficult=False), "val")[0][1]
    assert kept["iscrowd"].tolist()[0] == 1 and kept["iscrowd"].sum() == 1
    assert torch.equal(dropped["boxes"], kept["boxes"][1:])


def test_a_missing_voc_folder_names_the_layout(tmp_path):
    with pytest.raises(ConfigError, match="VOCdevkit/VOC2012/"):
        VOCSource(voc_cfg(tmp_path), "train")
    with pytest.raises(ConfigError, match="data.num_classes=3"):
        VOCDetData(classes=["a", "b"], num_classes=21).check()


def test_a_voc_folder_trains_and_eval_at_world_size_3_equals_the_last_validation(voc, tmp_path):
    pytest.importorskip("faster_coco_eval", reason="mAP needs faster-coco-eval (the [det] extra)")
    run = tmp_path / "run"
    run_ranks("train.py", *OURS, "model=tiny_det", "task=detection", f"data.root={voc}",
              "data.image_size=64", "data.num_workers=1", "data.batch_size=4",
              "trainer.epochs=2", "trainer.precision=32", "optim.lr=0.01", f"run_dir={run}",
              nproc=2)  # fmt: skip
    last = read_metrics(run)[-1]
    assert last["val/num_samples"] == 13
    out = tmp_path / "eval.json"
    run_ranks("eval.py", f"checkpoint={run}/checkpoints/last.pt", f"output={out}", nproc=3)
    assert json.loads(out.read_text())["map"] == last["val/map"]
    broken = edited(voc, tmp_path, CASES["outside"][0])
    bad = tmp_path / "bad"
    proc = run_forked("train.py", *OURS, "model=tiny_det", "task=detection",
                      f"data.root={broken}", f"run_dir={bad}")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert str(annotation(broken)) in proc.stderr and not bad.exists()
