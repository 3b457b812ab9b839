"""Dense probes: mIoU against a per-class loop, oracle / random / shuffled-label features through both
probes, patch features against a manual block loop, diagnostics against SVD and hand formulas, and
the real-dataset loaders on a fake ADE20K folder (nothing is downloaded)."""

from __future__ import annotations

import json

import pytest
import timm
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import Dataset

from vitattn.models import LocAtViT
from vitattn.probe import (
    ConfusionMeter,
    confusion_matrix,
    dense_probe,
    extract_dense_features,
    miou,
    patch_cls_alignment,
    patch_features,
    patch_label_distributions,
    pca_images,
    plot_pca_images,
    probe_features,
    scores_from_confusion,
)

K, S, P = 4, 16, 4  # classes, image side, patch side of the synthetic data
G = S // P


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- mIoU


def hand_miou(pred: list[int], target: list[int], k: int, ignore: int) -> tuple[float, list[float | None]]:
    ious: list[float | None] = []
    for c in range(k):
        tp = fp = fn = 0
        for p, t in zip(pred, target, strict=True):
            if t == ignore:
                continue
            tp += p == c and t == c
            fp += p == c and t != c
            fn += p != c and t == c
        ious.append(tp / (tp + fp + fn) if tp + fp + fn else None)
    present = [v for v in ious if v is not None]
    return (sum(present) / len(present) if present else float("nan")), ious


@given(
    st.integers(1, 5),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.integers(0, 2**31 - 1),
)
def test_miou_matches_per_class_loop(k: int, shape: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, k, shape, generator=g)
    target[torch.rand(shape, generator=g) < 0.2] = 255
    pred = torch.randint(0, k, shape, generator=g)
    ref, ref_ious = hand_miou(pred.flatten().tolist(), target.flatten().tolist(), k, 255)
    scores = scores_from_confusion(confusion_matrix(pred, target, k))
    if ref != ref:  # every pixel ignored
        assert scores.miou != scores.miou
    else:
        assert scores.miou == pytest.approx(ref)
        assert miou(pred, target, k) == pytest.approx(ref)
    for a, b in zip(scores.per_class_iou, ref_ious, strict=True):
        assert (a is None and b is None) or a == pytest.approx(b)


def test_confusion_rows_are_targets_and_ignore_is_dropped() -> None:
    target = torch.tensor([0, 0, 1, 255, 255])
    pred = torch.tensor([0, 1, 1, 7, 0])  # ignored pixels may hold anything, even out of range
    cm = confusion_matrix(pred, target, 3)
    assert cm.dtype == torch.int64
    assert cm.tolist() == [[1, 1, 0], [0, 1, 0], [0, 0, 0]]
    s = scores_from_confusion(cm)
    assert s.per_class_iou == [pytest.approx(0.5), pytest.approx(0.5), None]  # class 2 absent: left out
    assert s.miou == pytest.approx(0.5)
    assert s.pixel_acc == pytest.approx(2 / 3)


def test_confusion_meter_accumulates() -> None:
    g = torch.Generator().manual_seed(1)
    t, p = torch.randint(0, 3, (4, 5, 5), generator=g), torch.randint(0, 3, (4, 5, 5), generator=g)
    meter = ConfusionMeter(3)
    for i in range(4):
        meter.update(p[i], t[i])
    assert torch.equal(meter.matrix, confusion_matrix(p, t, 3))
    assert meter.scores().miou == pytest.approx(miou(p, t, 3))


def test_miou_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="pred has shape .* target has shape"):
        miou(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="target holds label 5"):
        miou(torch.zeros(3, dtype=torch.long), torch.tensor([0, 5, 1]), 2)
    with pytest.raises(ValueError, match="pred holds label -1"):
        miou(torch.tensor([0, -1, 1]), torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="num_classes"):
        miou(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), 0)


# ---------------------------------------------------------------- synthetic segmentation data


class Blocky(Dataset):
    """Masks of random rectangles at pixel positions (not aligned to the 4-px patches), 5 % ignore.

    The image carries its mask in channel 0 (``mask / 255``) so that an oracle "backbone" can read it;
    channels 1-2 are noise. Items ``(image, label, mask)``; ``mask_only=True`` gives ``(image, mask)``.
    """

    num_seg_classes = K

    def __init__(self, n: int, seed: int, mask_only: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images, self.masks, self.mask_only = [], [], mask_only
        for _ in range(n):
            m = torch.randint(0, K, (1, 1), generator=g).expand(S, S).clone()
            for _ in range(3):
                y0, x0 = torch.randint(0, S - 4, (2,), generator=g).tolist()
                h, w = torch.randint(3, 9, (2,), generator=g).tolist()
                m[y0 : y0 + h, x0 : x0 + w] = torch.randint(0, K, (1,), generator=g)
            m[torch.rand(S, S, generator=g) < 0.05] = 255
            img = torch.rand(3, S, S, generator=g)
            img[0] = m.float() / 255
            self.images.append(img)
            self.masks.append(m)

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, i: int) -> tuple:
        return (self.images[i], self.masks[i]) if self.mask_only else (self.images[i], 0, self.masks[i])


def oracle_backbone(x: torch.Tensor) -> torch.Tensor:
    """Each patch's label fractions (from the mask in channel 0) plus 2 pooled noise channels."""
    labels = (x[:, 0] * 255).round().long().clamp(max=K)  # 255 -> K: dropped below
    onehot = F.one_hot(labels, K + 1)[..., :K].permute(0, 3, 1, 2).float()
    return torch.cat([F.avg_pool2d(onehot, P), F.avg_pool2d(x[:, 1:], P)], 1)


def random_backbone(x: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(x[:, 1].sum() * 1e4) % 2**31)
    return torch.randn(x.shape[0], 16, G, G, generator=g)


@pytest.fixture(scope="module")
def data() -> tuple[Blocky, Blocky]:
    return Blocky(64, 0), Blocky(32, 1)


def ceiling(ds: Blocky) -> float:
    """mIoU of predicting every pixel with its patch's majority label (the patch-resolution ceiling)."""
    masks = torch.stack(ds.masks)
    frac = F.avg_pool2d(F.one_hot(masks.clamp(max=K), K + 1)[..., :K].permute(0, 3, 1, 2).float(), P)
    pred = frac.argmax(1).repeat_interleave(P, 1).repeat_interleave(P, 2)
    return miou(pred, masks, K)


def chance(ds: Blocky) -> float:
    """mIoU of uniformly random pixel labels."""
    masks = torch.stack(ds.masks)
    return miou(torch.randint(0, K, masks.shape, generator=torch.Generator().manual_seed(0)), masks, K)


FAST_LINEAR = dict(min_steps=100)  # the default 200 steps converge too; 100 keep the test short


@pytest.fixture(scope="module")
def oracle_features(data: tuple[Blocky, Blocky]):
    kw = dict(num_classes=K, progress=False)
    return extract_dense_features(oracle_backbone, data[0], **kw), extract_dense_features(
        oracle_backbone, data[1], **kw
    )


def test_probes_reach_the_patch_ceiling_on_oracle_features(data, oracle_features) -> None:
    top = ceiling(data[1])
    assert 0.6 < top < 0.95  # the rectangles really cut through patches
    tr, te = oracle_features
    lin = probe_features(tr, te, method="linear", progress=False, **FAST_LINEAR)
    knn = probe_features(tr, te, method="knn", progress=False)
    assert lin.miou > top - 0.05, (lin.miou, top)
    assert knn.miou > top - 0.05, (knn.miou, top)
    assert lin.layers == (0,) and lin.per_layer[0].alignment is None  # a callable has no class token


def test_probes_fail_without_signal(data, oracle_features) -> None:
    """Random features, and oracle features with the train masks shuffled across images: near chance."""
    low = chance(data[1]) + 0.1
    for method, opts in (("linear", FAST_LINEAR), ("knn", {})):
        r = dense_probe(random_backbone, *data, method=method, progress=False, **opts)
        assert r.miou < low, (method, r.miou, low)
    tr, te = oracle_features
    shuffled = type(tr)(
        tr.layers,
        tr.features,
        tr.masks[torch.randperm(len(tr))],
        tr.alignment,
        tr.num_classes,
        tr.ignore_index,
    )
    for method, opts in (("linear", FAST_LINEAR), ("knn", {})):
        r = probe_features(shuffled, te, method=method, progress=False, **opts)
        assert r.miou < low, (method, r.miou, low)


def test_dense_probe_options_items_and_errors(data) -> None:
    train, test = Blocky(16, 2, mask_only=True), Blocky(8, 3, mask_only=True)  # (image, mask) items
    a = dense_probe(oracle_backbone, train, test, method="knn", progress=False, k=3, temperature=0.1)
    b = dense_probe(oracle_backbone, train, test, method="knn", progress=False, k=3, temperature=0.1)
    assert a.miou == b.miou and a.options["k"] == 3
    lin1 = dense_probe(oracle_backbone, train, test, progress=False, epochs=3, seed=1)
    lin2 = dense_probe(oracle_backbone, train, test, progress=False, epochs=3, seed=1)
    assert lin1.to_dict() == lin2.to_dict()  # deterministic for a seed
    with pytest.raises(ValueError, match="'linear', 'knn'"):
        dense_probe(oracle_backbone, train, test, method="svm", progress=False)

    class NoK(Blocky):
        num_seg_classes = None

    with pytest.raises(ValueError, match="num_classes="):
        dense_probe(oracle_backbone, NoK(2, 0), NoK(2, 1), progress=False)
    with pytest.raises(ValueError, match="layer index 1"):
        dense_probe(oracle_backbone, train, test, layers=(1,), progress=False)
    bad = Blocky(2, 0)
    bad.masks[0] = bad.masks[0].clone()
    bad.masks[0][0, 0] = 9
    with pytest.raises(ValueError, match="mask holds label 9"):
        dense_probe(oracle_backbone, bad, test, progress=False)


def test_patch_label_distributions_by_hand() -> None:
    m = torch.full((1, 4, 4), 255)
    m[0, :2, :2] = torch.tensor([[0, 1], [1, 255]])
    m[0, 2:, 2:] = 2
    d = patch_label_distributions(m, (2, 2), 3, 255)
    assert d[0, 0, 0].tolist() == pytest.approx([1 / 3, 2 / 3, 0])
    assert d[0, 0, 1].tolist() == [0, 0, 0]  # all ignore
    assert d[0, 1, 1].tolist() == [0, 0, 1]


def test_probe_result_json_and_table(oracle_features) -> None:
    tr, te = oracle_features
    r = probe_features(tr, te, method="knn", progress=False, k=5)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["method"] == "knn" and d["layers"] == [0] and d["options"]["k"] == 5
    assert d["per_layer"][0]["miou"] == pytest.approx(r.miou)
    assert r.per_class_iou == r.per_layer[0].per_class_iou
    assert f"{100 * r.miou:.2f}" in r.table() and f"{100 * r.pixel_acc:.2f}" in r.table()


def test_progress_writes_no_carriage_returns(data, capsys) -> None:
    dense_probe(oracle_backbone, Blocky(8, 0), Blocky(4, 1), method="knn", batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and "probe: train features 4/4 batches" in err


# ---------------------------------------------------------------- patch features of real ViTs


def tiny_vit(**kw) -> VisionTransformer:
    return timm.create_model(
        "vit_tiny_patch16_224",
        img_size=S,
        patch_size=P,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=0,
        **kw,
    )


def manual_tokens(model: VisionTransformer, x: torch.Tensor) -> list[torch.Tensor]:
    """Block outputs ``(B, N, C)`` through the final norm, by a plain loop."""
    with torch.no_grad():
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        out = []
        for blk in model.blocks:
            h = blk(h)
            out.append(model.norm(h))
    return out


def split(tokens: torch.Tensor, prefix: int) -> torch.Tensor:
    b, _, c = tokens.shape
    return tokens[:, prefix:].transpose(1, 2).reshape(b, c, G, G)


@pytest.mark.parametrize("kind", ["timm", "locat", "hooks"])
def test_patch_features_match_a_manual_block_loop(kind: str) -> None:
    if kind == "timm":
        model = tiny_vit(reg_tokens=1)
    elif kind == "locat":
        model = LocAtViT(img_size=S, patch_size=P, embed_dim=32, depth=3, num_heads=2, num_classes=0)
    else:

        class NoIntermediates(VisionTransformer):
            forward_intermediates = None  # type: ignore[assignment]

        model = NoIntermediates(img_size=S, patch_size=P, embed_dim=32, depth=3, num_heads=2, num_classes=0)
    model.train()
    x = torch.randn(2, 3, S, S)
    maps = patch_features(model, x, layers=(-1, 0))
    assert list(maps) == [0, 2] and model.training  # sorted non-negative indices; flag restored
    model.eval()
    ref = manual_tokens(model, x)
    prefix = model.num_prefix_tokens
    for i in (0, 2):
        assert maps[i].patches.shape == (2, 32, G, G)
        torch.testing.assert_close(maps[i].patches, split(ref[i], prefix), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(maps[i].cls, ref[i][:, 0], atol=1e-5, rtol=1e-5)
    raw = patch_features(model, x, layers=(1,), norm=False)[1]
    with torch.no_grad():
        want = (
            model.forward_intermediates(x, indices=[1], intermediates_only=True) if kind != "hooks" else None
        )
    if want is not None:
        torch.testing.assert_close(raw.patches, want[0])


def test_patch_features_layer_validation() -> None:
    model, x = tiny_vit(), torch.rand(1, 3, S, S)
    with pytest.raises(ValueError, match="layer index 3 is out of range"):
        patch_features(model, x, layers=(3,))
    with pytest.raises(ValueError, match="layers is empty"):
        patch_features(model, x, layers=())
    with pytest.raises(TypeError, match="layers must hold block indices"):
        patch_features(model, x, layers=(1.0,))
    with pytest.raises(ValueError, match="layer index -2"):
        patch_features(oracle_backbone, x, layers=(-2,))
    assert list(patch_features(oracle_backbone, x)) == [0]


def test_alignment_of_a_model_matches_its_tokens(data) -> None:
    model = tiny_vit()
    feats = extract_dense_features(
        model, data[1], layers=(0, -1), num_classes=K, progress=False, batch_size=8
    )
    tokens = manual_tokens(model, torch.stack(data[1].images))
    for i in (0, 2):
        t = tokens[i]
        cos = (F.normalize(t[:, 1:], dim=-1) * F.normalize(t[:, :1], dim=-1)).sum(-1)
        assert feats.alignment[i] == pytest.approx(float(cos.mean()), abs=1e-5)


# ---------------------------------------------------------------- diagnostics


def test_patch_cls_alignment_hand_formula() -> None:
    g = torch.Generator().manual_seed(3)
    tok, cls = torch.randn(2, 5, 6, generator=g), torch.randn(2, 6, generator=g)
    ref = (
        sum(
            float(tok[b, n] @ cls[b] / (tok[b, n].norm() * cls[b].norm())) for b in range(2) for n in range(5)
        )
        / 10
    )
    assert patch_cls_alignment(tok, cls) == pytest.approx(ref, abs=1e-6)
    grid = tok[:, :4].transpose(1, 2).reshape(2, 6, 2, 2)
    assert patch_cls_alignment(grid, cls) == pytest.approx(patch_cls_alignment(tok[:, :4], cls), abs=1e-6)
    assert patch_cls_alignment(cls[:, None].repeat(1, 3, 1) * 2, cls) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="cls_token must be"):
        patch_cls_alignment(tok, cls[:1])


def test_pca_images_match_svd() -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 8, 4, 5, generator=g) * torch.linspace(3, 0.1, 8).view(1, 8, 1, 1)
    out = pca_images(f)
    assert out.shape == (3, 3, 4, 5) and out.min() >= 0 and out.max() <= 1
    x = f.permute(0, 2, 3, 1).reshape(-1, 8)
    _, _, v = torch.linalg.svd(x - x.mean(0))
    for c in range(3):
        p = (x - x.mean(0)) @ v[c]
        p = ((p - p.min()) / (p.max() - p.min())).reshape(3, 4, 5)
        got = out[:, c]
        assert torch.allclose(got, p, atol=1e-4) or torch.allclose(got, 1 - p, atol=1e-4)
    # the sign is fixed by the components, not by the SVD: negated features give the inverted picture
    torch.testing.assert_close(pca_images(-f), 1 - out, atol=1e-4, rtol=0)
    # fit on other features, project these: still in [0, 1]
    fit = pca_images(f[:1], fit_on=f)
    assert fit.shape == (1, 3, 4, 5) and 0 <= fit.min() and fit.max() <= 1
    two = pca_images(torch.randn(1, 2, 3, 3))  # fewer than three channels: the rest are zeros
    assert two[:, 2].abs().max() == 0


def test_plot_pca_images(tmp_path) -> None:
    images = torch.rand(2, 3, S, S)
    pcas = {"block 0": torch.rand(2, 3, G, G), "block 2": torch.rand(2, 3, G, G)}
    fig = plot_pca_images(images, pcas, tmp_path / "pca.png")
    assert (tmp_path / "pca.png").stat().st_size > 0 and len(fig.axes) == 6
    with pytest.raises(ValueError, match="pcas\\['x'\\]"):
        plot_pca_images(images, {"x": torch.rand(1, 3, G, G)})


# ---------------------------------------------------------------- real datasets (no download)


def test_ade20k_loader_on_a_fake_folder(tmp_path) -> None:
    from PIL import Image

    from vitattn.datasets import ADE20KSegmentation

    for folder, n in (("training", 2), ("validation", 1)):
        (tmp_path / "ADEChallengeData2016" / "images" / folder).mkdir(parents=True)
        (tmp_path / "ADEChallengeData2016" / "annotations" / folder).mkdir(parents=True)
        for i in range(n):
            rgb = (torch.rand(20, 30, 3) * 255).byte().numpy()
            lab = torch.zeros(20, 30, dtype=torch.uint8)
            lab[:, 15:] = 150
            lab[:, 10:15] = 1
            stem = f"ADE_{folder}_{i:08d}"
            Image.fromarray(rgb).save(tmp_path / "ADEChallengeData2016" / "images" / folder / f"{stem}.jpg")
            Image.fromarray(lab.numpy(), mode="L").save(
                tmp_path / "ADEChallengeData2016" / "annotations" / folder / f"{stem}.png"
            )
    ds = ADE20KSegmentation(tmp_path, "train", image_size=10)
    assert len(ds) == 2 and len(ADE20KSegmentation(tmp_path, "val", image_size=10)) == 1
    assert ds.num_seg_classes == 150 == len(ds.class_names) and ds.ignore_index == 255
    image, mask = ds[0]
    assert (
        image.shape == (3, 10, 10) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    )
    assert mask.shape == (10, 10) and mask.dtype == torch.int64
    # 20x30 -> 10x15, centre crop of columns 2..12: 0 ("other") -> 255, 1 -> 0, 150 -> 149
    assert mask[0].tolist() == [255] * 3 + [0] * 3 + [149] * 4


def test_missing_datasets_name_the_folder(tmp_path) -> None:
    from vitattn.datasets import ADE20KSegmentation, SegmentationDatasetMissing, VOCSegmentation

    with pytest.raises(SegmentationDatasetMissing, match="VOCdevkit/VOC2012.*--download") as err:
        VOCSegmentation(tmp_path, "val")
    assert isinstance(err.value, FileNotFoundError) and str(tmp_path) in str(err.value)
    with pytest.raises(SegmentationDatasetMissing, match="ADEChallengeData2016"):
        ADE20KSegmentation(tmp_path, "train")
    with pytest.raises(ValueError, match="split"):
        ADE20KSegmentation(tmp_path, "test")


def test_knn_weights_follow_similarity() -> None:
    """Bank: patch (1, 0) labelled 0, patch (0.6, 0.8) labelled 1; a query near the first is class 0
    with k = 2 (both neighbours vote, the closer one by softmax(cos / T) more), and vice versa."""
    from vitattn.probe import DenseFeatures

    bank = torch.tensor([[1.0, 0.6], [0.0, 0.8]]).view(1, 2, 1, 2)
    train = DenseFeatures((0,), {0: bank}, torch.tensor([[[0, 1]]]), {0: None}, 2, 255)
    queries = torch.tensor([[0.95, 0.5], [0.3, 0.9]]).view(1, 2, 1, 2)
    test = DenseFeatures((0,), {0: queries}, torch.tensor([[[0, 1]]]), {0: None}, 2, 255)
    r = probe_features(train, test, method="knn", k=2, temperature=0.1, progress=False)
    assert r.pixel_acc == 1.0


def test_unsized_dataset_and_non_tensor_block_outputs_are_named(data) -> None:
    """An iterable-style dataset (no ``__len__``) is refused with a TypeError naming ``dataset``;
    a block whose output holds no tensor is named by its index (hooks path, no forward_intermediates)."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(data[1][i] for i in range(2))

    with pytest.raises(TypeError, match=r"dataset must be a map-style dataset with __len__, got Stream"):
        extract_dense_features(oracle_backbone, Stream(), num_classes=K, progress=False)

    class NoIntermediates(VisionTransformer):
        forward_intermediates = None  # type: ignore[assignment]

    model = NoIntermediates(img_size=S, patch_size=P, embed_dim=32, depth=2, num_heads=2, num_classes=0)
    model.blocks[1].register_forward_hook(lambda _m, _i, _o: {"tokens": _o})
    with pytest.raises(TypeError, match=r"blocks\[1\] returned dict; expected tokens \(B, N, C\)"):
        patch_features(model, torch.randn(1, 3, S, S), layers=(1,))


def test_images_that_are_not_a_multiple_of_the_patch_are_refused() -> None:
    """A 16-px-patch ViT on 40 px images would see a 2x2 grid and never the last 8 pixel rows and columns
    (nor the masks under them): refused at the first batch, naming both sizes."""
    from vitattn.probe.features import check_image_size, patch_size_of

    vit = timm.create_model("vit_tiny_patch16_224", img_size=40, depth=1, num_classes=0)
    items = [(torch.rand(3, 40, 40), torch.zeros(40, 40, dtype=torch.int64)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"image size 40 is not a multiple of the patch size 16 .*32 or 48"):
        extract_dense_features(vit, items, num_classes=K, progress=False)
    assert patch_size_of(vit) == (16, 16) and patch_size_of(torch.nn.Linear(2, 2)) is None
    check_image_size(vit, 48)
    check_image_size(torch.nn.Linear(2, 2), 41)  # no patches: nothing to check
    with pytest.raises(ValueError, match=r"size 48x40 is not a multiple of the patch size 16 .* 0 pixel row"):
        check_image_size(vit, (48, 40), "size")
