import pytest
import torch

from data.batch import Batch, PackedGenericDataItem


def test_item_slice_concat_as_tensor():
    a, b = torch.ones(4, 3), torch.zeros(2, 3)
    item = PackedGenericDataItem([a, None, b], dim=0)
    assert len(item) == 3
    assert item.as_tensor().shape == (6, 3)
    sub = item.slice([2, 0, 0])
    assert sub[1] is a and sub[2] is a  # shared, not copied
    assert torch.equal(sub.as_tensor(), torch.cat([b, a, a]))
    assert item.slice([1]).as_tensor() is None
    joined = PackedGenericDataItem.concat([item, sub])
    assert len(joined) == 6 and joined.as_tensor().shape == (16, 3)
    with pytest.raises(ValueError, match="different dims"):
        PackedGenericDataItem.concat([item, PackedGenericDataItem([a], dim=1)])


def test_batch_keeps_images_with_sequences():
    pix = [torch.full((4, 2), float(i)) if i % 2 == 0 else None for i in range(6)]
    two = torch.full((8, 2), 9.0)
    pix[4] = two  # two images in one sample
    grids = [torch.tensor([[1, 2, 2]]) if p is not None else None for p in pix]
    grids[4] = torch.tensor([[1, 2, 2], [1, 2, 2]])
    batch = Batch({"input_ids": [torch.arange(i + 1) for i in range(6)], "pixel_values": pix, "image_grid_thw": grids})
    for rank in range(2):
        shard = batch.shard(rank, 2)
        assert len(shard) == 3
        for j in range(3):
            i = rank * 3 + j
            assert shard["input_ids"][j].numel() == i + 1
            assert shard["pixel_values"][j] is pix[i]
    mb = batch.slice([4, 0, 1])
    assert mb["pixel_values"].as_tensor().shape[0] == 8 + 4
    assert mb["image_grid_thw"].as_tensor().shape[0] == 3
    with pytest.raises(ValueError, match="does not divide"):
        batch.shard(0, 4)
    with pytest.raises(ValueError, match="has 2 samples"):
        batch["x"] = [torch.zeros(1), torch.zeros(1)]
    assert len(Batch.concat([batch.slice([0]), batch.slice([1, 2])])) == 3
