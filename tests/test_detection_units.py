"""Detection pieces: the digit canvases and their boxes, the detector's shapes, and mAP that
is the same at any world size (real gloo processes, ranks holding different numbers of
images)."""

from __future__ import annotations

import pytest
import torch
from torchmetrics import MetricCollection

pytest.importorskip(
    "faster_coco_eval", reason="mAP needs faster-coco-eval (make install: the [det] extra)"
)

from helpers.launch import in_gloo_group  # noqa: E402

from ddp_utils.config import DigitsDetData  # noqa: E402
from ddp_utils.data.detection.canvases import DetCanvasSource, ink_box  # noqa: E402
from ddp_utils.data.samplers import EvalShardSampler  # noqa: E402
from ddp_utils.evaluation import BatchOrder  # noqa: E402
from ddp_utils.tasks.detection import ExactMeanAveragePrecision  # noqa: E402


def test_canvases_hold_tight_non_overlapping_boxes_of_their_own_splits_digits():
    cfg = DigitsDetData(image_size=64)
    train, val = DetCanvasSource(cfg, "train"), DetCanvasSource(cfg, "val")
    assert len(train) == 1438 and len(val) == 359
    again = DetCanvasSource(cfg, "val")  # the same layout on every rank and machine
    assert torch.equal(val.images, again.images)
    for i in range(50):
        image, target = val[i]
        boxes, labels = target["boxes"], target["labels"]
        assert image.shape == (1, 64, 64) and 1 <= len(boxes) <= 3 and len(labels) == len(boxes)
        assert labels.min() >= 1 and labels.max() <= 10
        for x0, y0, x1, y1 in boxes.int().tolist():
            assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
            # tight: the box's border rows and columns hold ink
            assert ink_box(image[0, y0:y1, x0:x1]) == (0, 0, x1 - x0, y1 - y0)
        b = boxes.tolist()
        for j in range(len(b)):
            for k in range(j):
                assert not (b[j][0] < b[k][2] and b[k][0] < b[j][2] and b[j][1] < b[k][3]
                            and b[k][1] < b[j][3])  # fmt: skip


def random_detections(n: int, seed: int) -> tuple[list[dict], list[dict]]:
    g = torch.Generator().manual_seed(seed)
    preds, targets = [], []
    for _ in range(n):
        k = int(torch.randint(1, 4, (), generator=g))
        xy = torch.rand(k, 2, generator=g) * 40
        boxes = torch.cat([xy, xy + 8 + torch.rand(k, 2, generator=g) * 8], 1)
        labels = torch.randint(1, 4, (k,), generator=g)
        jitter = boxes + torch.randn(k, 4, generator=g)
        # equal scores on purpose: COCO's evaluation breaks ties by the images' order
        scores = torch.full((k,), 0.5) if k == 2 else torch.rand(k, generator=g)
        preds.append({"boxes": jitter, "scores": scores, "labels": labels})
        targets.append({"boxes": boxes, "labels": labels})
    return preds, targets


BATCH = 2  # 7 images: canonical batches of 2, 2, 2 and 1


def scored(rank: int, world: int, n: int) -> dict:
    """mAP as the evaluation computes it: this rank's canonical batches, joined in order."""
    preds, targets = random_detections(n, seed=0)
    metric = ExactMeanAveragePrecision(class_metrics=True)
    metrics = MetricCollection({"map": metric}, compute_groups=False)
    order = BatchOrder(metrics)
    for k in EvalShardSampler(n, world, rank, BATCH).batches():
        order.start_batch()
        metric.update(preds[k * BATCH : (k + 1) * BATCH], targets[k * BATCH : (k + 1) * BATCH])
        order.end_batch(k, torch.zeros(4, dtype=torch.float64))
    order.join(world)
    return {k: v.tolist() for k, v in order.compute(metrics).items()}


@pytest.mark.parametrize("world", [2, 3])
def test_map_is_the_same_at_any_world_size_with_uneven_shards(world, tmp_path):
    """7 images in batches of 2: 4+3 and 3+2+2 images per rank. torchmetrics' own sync aborts
    on this (gloo's size mismatch); joined in batch order, every number equals world size
    1's, which is torchmetrics' own number on all images."""
    preds, targets = random_detections(7, seed=0)
    alone = ExactMeanAveragePrecision(class_metrics=True)
    alone.update(preds, targets)
    expected = {k: v.tolist() for k, v in alone.compute().items()}
    assert scored(0, 1, 7) == expected
    assert in_gloo_group(scored, world, tmp_path, 7) == expected
    assert 0 < expected["map"] < 1
