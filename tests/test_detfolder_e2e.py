"""data=detfolder: a COCO-format folder with images of two sizes trains at world size 2 and
evaluates identically at world sizes 1 and 3; every malformed annotation stops with exit 2 and
one message naming the file and the annotation."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from detfolders import write_coco_folder
from helpers.launch import run_forked, run_ranks
from helpers.runs import read_metrics

pytest.importorskip(
    "faster_coco_eval", reason="mAP needs faster-coco-eval (make install: the [det] extra)"
)

# data.num_classes is left to the annotations (2 categories: 3 with the background).
RUN = ("data=detfolder", "model=tiny_det", "task=detection", "data.image_size=64",
       "data.num_workers=1", "data.batch_size=4", "trainer.epochs=2", "trainer.precision=32",
       "optim.lr=0.01")  # fmt: skip


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return write_coco_folder(tmp_path_factory.mktemp("coco"))


def test_a_coco_folder_trains_and_scores_the_same_at_world_sizes_1_and_3(coco, tmp_path):
    run = tmp_path / "run"
    proc = run_ranks("train.py", *RUN, f"data.root={coco}", f"run_dir={run}", nproc=2)
    assert read_metrics(run)[-1]["val/num_samples"] == 13
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["num_classes"] == 3
    # 16-bit, palette and RGBA images were read; COCO's tables stayed out of the log.
    assert "Average Precision" not in proc.stdout + proc.stderr + (run / "train.log").read_text()
    results = {}
    for n in (1, 3):
        out = tmp_path / f"eval{n}.json"
        run_ranks("eval.py", f"checkpoint={run}/checkpoints/last.pt", f"output={out}", nproc=n)
        results[n] = json.loads(out.read_text())
    for key in ("map", "map_50", "map_per_class", "num_samples"):
        assert results[1][key] == results[3][key], key
    assert results[1]["map"] == read_metrics(run)[-1]["val/map"]


def broken(coco, tmp_path, change) -> str:
    """A copy of the folder with one change to val.json; the message eval... train.py gives."""
    folder = tmp_path / "broken"
    shutil.copytree(coco, folder)
    path = folder / "annotations" / "val.json"
    doc = json.loads(path.read_text())
    change(doc, folder)
    path.write_text(json.dumps(doc))
    proc = run_forked("train.py", *RUN, f"data.root={folder}", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
    assert str(path) in proc.stderr
    return proc.stderr


def first_ann(doc):
    return doc["annotations"][0]


CASES = {
    "outside": (lambda d, f: first_ann(d).update(bbox=[50, 40, 30, 30]), "outside its"),
    "zero area": (lambda d, f: first_ann(d).update(bbox=[5, 5, 0, 8]), "zero area"),
    "category": (lambda d, f: first_ann(d).update(category_id=7), "has category_id 7"),
    "image id": (lambda d, f: first_ann(d).update(image_id=999), "names image_id 999"),
    "missing file": (
        lambda d, f: (f / "images" / d["images"][0]["file_name"]).unlink(),
        "which does not exist",
    ),
    "bbox shape": (lambda d, f: first_ann(d).update(bbox=[1, 2, 3]), "A bbox is [x, y, width"),
    # num_classes comes from val.json (4 with the background); train.json is checked against it
    "categories": (
        lambda d, f: d["categories"].append({"id": 9, "name": "extra"}),
        "has 2 categories, so data.num_classes=3 (with the background); it is 4",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_annotation_stops_with_the_file_and_the_fix(coco, tmp_path, case):
    change, message = CASES[case]
    assert message in broken(coco, tmp_path, change)
