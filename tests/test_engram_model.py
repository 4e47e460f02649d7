"""V4.1 Engram layers read their rows through a fetcher, and ``engram_placement`` chooses where the tables live.

The dequantisation of an FP8 row is exact, so the logits must be bit-identical whether the rows come from
the model's own tables (``device``), from the host's shared-memory segment (``host``) or from the shards of
two gloo ranks (``sharded``). The host and sharded models hold no table; closing unmaps the segment, and no
segment name is left in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engram_harness import maps_segment

from dsinfer.cli import main
from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engram.fetch import PLACEMENT_ENV, HostEngramFetcher, ShardedEngramFetcher
from dsinfer.engram.module import EngramTableFetcher
from dsinfer.engram.placement import PlacedEngramTables
from dsinfer.engram.store import SHM_DIR, EngramStoreError, default_segment_name
from dsinfer.kv.batch import PackedBatch
from dsinfer.llm import LLM
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import make_tiny_checkpoint
from dsinfer.server import launch

SEQUENCES = {  # two ranks' batches: sequences longer than the sliding window (16), so CED replays a suffix
    0: [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 17)],
    1: [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (23, 31, 9)],
}


@pytest.fixture(autouse=True)
def _placement_from_arguments_only(monkeypatch):
    """The tests name their placement; a stray $DSINFER_ENGRAM_PLACEMENT must not choose it for them."""
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def device_model(tiny_v41_checkpoint) -> DeepseekV41:
    return load_model(tiny_v41_checkpoint, progress=False, engram_placement="device")


def _forwards(model: DeepseekV41, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Logits of a plain forward and of a CED prefill (whose decoder layers read a slice of the rows)."""
    with torch.inference_mode():
        return {
            "forward": model(PackedBatch.from_sequences(sequences)),
            "bounded": model.prefill(
                PackedBatch.from_sequences(sequences), mode="bounded", replay_tokens=model.config.sliding_window
            ),
        }


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def _segment_path(checkpoint: Path) -> Path:
    """Where the host placement makes ``checkpoint``'s segment: its name is this test process's own (other processes
    on the host, the other xdist worker's included, make and remove theirs meanwhile)."""
    return SHM_DIR / default_segment_name(str(Path(checkpoint).resolve()))


# ---------------------------------------------------------------------------------------------- placements
def test_host_placement_is_bit_identical_and_holds_no_table(tiny_v41_checkpoint, device_model):
    host = load_model(tiny_v41_checkpoint, progress=False, engram_placement="host")
    try:
        tables = host.engram_fetcher
        assert isinstance(tables, PlacedEngramTables) and isinstance(tables.fetcher, HostEngramFetcher)
        store = tables.store
        assert not any("engram.embed" in name for name in host.state_dict())  # no table in the model
        assert all(block.engram.embed is None for block in host.layers if block.engram is not None)
        # Rows are read in the segment, in place (the test keeps no tensor over it, which would keep it mapped).
        assert tables.fetcher.tables[1][0].data_ptr() == store.weight(1).data_ptr()
        _assert_bit_identical(_forwards(host, SEQUENCES[0]), _forwards(device_model, SEQUENCES[0]))
    finally:
        host.close()
    assert not maps_segment(store) and store.path == _segment_path(tiny_v41_checkpoint) and not store.path.exists()


def _sharded_rank(rank: int, port: int, checkpoint: str, out_path: str | None) -> dict[str, torch.Tensor]:
    """One rank of the sharded placement: load, run its own batch (the forwards are collective)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = load_model(checkpoint, progress=False, engram_placement="sharded")
        try:
            fetcher = model.engram_fetcher.fetcher
            assert isinstance(fetcher, ShardedEngramFetcher) and model.engram_fetcher.store is None
            shard_rows = fetcher.tables[1][0].shape[0]
            assert shard_rows < model.config.engram_num_embeddings[0]  # this rank holds only its slice
            results = _forwards(model, SEQUENCES[rank])
        finally:
            model.close()
    finally:
        dist.destroy_process_group()
    if out_path is not None:
        torch.save(results, out_path)
    return results


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sharded_placement_over_two_gloo_ranks_is_bit_identical(tiny_v41_checkpoint, device_model, tmp_path):
    """Rank 1 runs in a spawned process, this one is rank 0; each runs a different batch, as DP ranks do."""
    port, out_path = _free_port(), tmp_path / "rank1.pt"
    args = (1, port, str(tiny_v41_checkpoint), str(out_path))
    child = multiprocessing.get_context("spawn").Process(target=_sharded_rank, args=args)
    child.start()
    try:
        results = {0: _sharded_rank(0, port, str(tiny_v41_checkpoint), None)}
    finally:
        child.join(timeout=120)
    assert child.exitcode == 0
    results[1] = torch.load(out_path)
    for rank in (0, 1):
        _assert_bit_identical(results[rank], _forwards(device_model, SEQUENCES[rank]))
    assert not _segment_path(tiny_v41_checkpoint).exists()


def test_sharded_without_a_process_group_is_one_clear_error(tiny_v41_checkpoint):
    with pytest.raises(
        ValueError, match=r"'sharded' splits the Engram tables over .* process group, and none is initialised.*'host'"
    ):
        load_model(tiny_v41_checkpoint, progress=False, engram_placement="sharded")


def test_checkpoint_without_engram_layers_ignores_the_placement(tiny_checkpoint):
    model = load_model(tiny_checkpoint, progress=False, engram_placement="sharded")  # no process group needed
    assert isinstance(model, DeepseekV4)
    assert not _segment_path(tiny_checkpoint).exists()  # none made


def test_host_placement_needs_fp8_tables_and_plain_float_tables_stay_in_the_model(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "bf16", seed=1, arch="v41", quantized=False)
    with pytest.raises(EngramStoreError, match=r"layers\.1\.engram\.embed\.weight has dtype BF16"):
        load_model(directory, progress=False, engram_placement="host")
    model = load_model(directory, progress=False)
    table = model.layers[1].engram.embed
    assert table.weight.dtype == torch.float32 and bool((table.scale == 1).all())  # plain floats, unit scales
    ids = torch.tensor([[0, 5], [17, 3]])
    assert torch.equal(model.engram_source().fetch(ids, 1), table.weight[ids])
    logits = model(PackedBatch.from_sequences(SEQUENCES[0]))
    assert bool(logits.isfinite().all())


# ---------------------------------------------------------------------------------------------- the fetch path
class RecordingFetcher:
    """Wraps a fetcher: logs ``start`` / ``wait`` and, for ``shifted_layer``, adds one to every row value."""

    def __init__(self, inner, log: list, shifted_layer: int | None = None) -> None:
        self.inner, self.log, self.shifted_layer = inner, log, shifted_layer
        self.started: dict[int, torch.Tensor] = {}
        self.closed = False

    @property
    def layer_ids(self) -> list[int]:
        return self.inner.layer_ids

    def rows(self, layer_id: int) -> int:
        return self.inner.rows(layer_id)

    def start(self, row_ids_per_layer) -> None:
        self.log.append(("start", sorted(row_ids_per_layer)))
        self.started = {layer: ids.clone() for layer, ids in row_ids_per_layer.items()}
        self.inner.start(row_ids_per_layer)

    def wait(self, layer_id: int) -> torch.Tensor:
        self.log.append(("wait", layer_id))
        rows = self.inner.wait(layer_id)
        return rows + 1 if layer_id == self.shifted_layer else rows

    def close(self) -> None:
        self.closed = True


def _own_tables(model: DeepseekV41) -> EngramTableFetcher:
    return EngramTableFetcher({block.layer_id: block.engram.embed for block in model.layers if block.engram})


def test_engram_layers_read_their_rows_through_the_fetcher(device_model):
    model, batch = device_model, lambda: PackedBatch.from_sequences(SEQUENCES[0])
    log: list = []
    recording = RecordingFetcher(_own_tables(model), log)
    with torch.inference_mode():
        baseline = model(batch())
    hooks = [block.register_forward_pre_hook(lambda m, a: log.append(("block", m.layer_id))) for block in model.layers]
    try:
        with torch.inference_mode():
            model.attach_engram_fetcher(recording)
            assert torch.equal(model(batch()), baseline)
            # One start with every layer's ids before any block; each layer's rows collected inside its block.
            blocks = [("block", i) for i in range(model.config.num_hidden_layers)]
            assert log == [("start", [1, 6]), *blocks[:2], ("wait", 1), *blocks[2:7], ("wait", 6), *blocks[7:]]
            for hook in hooks:
                hook.remove()
            ids = model.context(batch()).engram_rows  # what the hasher gives for the same fresh sequences
            for index, layer in enumerate(model.config.engram_layer_ids):
                assert torch.equal(recording.started[layer], ids[:, index])

            for layer in model.config.engram_layer_ids:  # rows changed behind the fetcher change the logits
                model.attach_engram_fetcher(RecordingFetcher(_own_tables(model), [], shifted_layer=layer))
                assert not torch.equal(model(batch()), baseline)
            assert recording.closed  # attaching another fetcher closed the one before
            last = model.engram_fetcher
            model.attach_engram_fetcher(None)  # back to the layers' own tables
            assert last.closed and torch.equal(model(batch()), baseline)

        partial = RecordingFetcher(EngramTableFetcher({1: model.layers[1].engram.embed}), [])
        with pytest.raises(ValueError, match=r"holds tables of layers \[1\], the model has Engram layers \[1, 6\]"):
            model.attach_engram_fetcher(partial)
        assert partial.closed and model.engram_fetcher is None  # a rejected fetcher is closed, not attached
    finally:
        for hook in hooks:
            hook.remove()
        model.attach_engram_fetcher(None)


def test_ced_prefill_keeps_the_first_decoder_layers_rows_for_the_replay(tmp_path):
    """With Engram on the first decoder layer, CED runs it twice (compressor pass, replay) on one fetch."""
    directory = make_tiny_checkpoint(tmp_path / "ced", seed=2, arch="v41", engram_layer_ids=(1, 5))
    device = load_model(directory, progress=False, engram_placement="device")
    assert device.config.decoder_start == 5
    log: list = []
    device.attach_engram_fetcher(RecordingFetcher(device.engram_source(), log))
    expected = _forwards(device, SEQUENCES[1])
    assert log.count(("wait", 5)) == 2  # one per forward: the CED prefill fetched layer 5's rows once
    host = load_model(directory, progress=False, engram_placement="host")
    try:
        _assert_bit_identical(_forwards(host, SEQUENCES[1]), expected)
    finally:
        host.close()


# ---------------------------------------------------------------------------------------------- lifetime
def test_llm_close_unmaps_the_segment_and_leaves_no_name(tiny_v41_checkpoint):
    with LLM(tiny_v41_checkpoint, engram_placement="host", max_model_len=64) as llm:
        store = llm.model.engram_fetcher.store
        assert maps_segment(store)  # the tables are mapped from the segment ...
        assert store.path == _segment_path(tiny_v41_checkpoint) and not store.path.exists()  # ... whose name is gone
    assert not maps_segment(store)
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="Engram tables live outside it .* no fetcher is attached"):
        llm.model(PackedBatch.from_sequences(SEQUENCES[0]))


# ---------------------------------------------------------------------------------------------- user entries
def test_generate_with_host_placement_equals_device(tiny_v41_checkpoint, capsys):
    def generate(placement: str) -> str:
        argv = ["generate", str(tiny_v41_checkpoint), "--prompt", "Hello world", "--prompt", "the fox"]
        assert main([*argv, "--max-tokens", "6", "--device", "cpu", "--engram-placement", placement]) == 0
        return capsys.readouterr().out.split("tokens in")[0]

    device = generate("device")
    assert "'Hello world' -> " in device and "'the fox' -> " in device
    assert generate("host") == device


def test_bad_placement_values_give_one_clear_error(tiny_v41_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_v41_checkpoint), "--engram-placement", "hots"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--engram-placement: invalid choice: 'hots'" in err and "'device', 'host', 'sharded'" in err
    with pytest.raises(ConfigError, match=r"'engram_placement': expected one of device, host, sharded .*'gpu'"):
        EngineConfig(engram_placement="gpu")
    with pytest.raises(ConfigError, match="'engram_placement'"):
        LLM(tiny_v41_checkpoint, engram_placement="HOST")


def test_serve_hands_the_placement_to_the_server_and_its_llm(tiny_v41_checkpoint, monkeypatch):
    launched = {}
    monkeypatch.setattr(launch, "serve", lambda options, engine: launched.update(options=options, engine=engine) or 0)
    assert main(["serve", str(tiny_v41_checkpoint), "--engram-placement", "host"]) == 0
    assert launched["engine"].engram_placement == "host"

    config = EngineConfig(engram_placement="host", max_model_len=64)
    app, engine = launch.build_server(launch.ServeOptions(model=str(tiny_v41_checkpoint)), config)
    llm = app.state.llm  # what serve() closes after the engine thread stops
    try:
        store = llm.model.engram_fetcher.store
        assert llm.engine is engine.engine and maps_segment(store)
    finally:
        llm.close()
    assert not maps_segment(store)
