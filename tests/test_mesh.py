"""Named meshes: layout arithmetic and construction from a torch DeviceMesh."""
import pytest
import torch
import torch.distributed as dist

from autoshard import Mesh


def test_row_major_coords_and_groups():
    mesh = Mesh({"dp": 2, "tp": 2})
    assert mesh.size == 4 and mesh.names == ("dp", "tp") and mesh.shape == (2, 2)
    assert [mesh.coords(r) for r in range(4)] == [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1},
                                                  {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert mesh.groups("tp") == [[0, 1], [2, 3]]
    assert mesh.groups("dp") == [[0, 2], [1, 3]]
    assert all(mesh.rank_of(mesh.coords(r)) == r for r in range(4))


@pytest.mark.parametrize("axes,match", [({}, "at least one axis"), ({"tp": 0}, "positive"),
                                        ({"t p": 2}, "identifier")])
def test_bad_meshes(axes, match):
    with pytest.raises(ValueError, match=match):
        Mesh(axes)


def test_unknown_axis_is_named():
    with pytest.raises(ValueError, match=r"unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        Mesh({"dp": 2, "tp": 2}).group("pp", 0)


def test_from_device_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        mesh = Mesh(dm)
        assert mesh.axes == {"dp": 1, "tp": 1} and mesh.device_mesh is dm
    finally:
        dist.destroy_process_group()
