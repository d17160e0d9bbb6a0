"""`llmgw ctl plan MODEL`: a model's architecture read from the real mirror (its byte port and
management API, in process over a directory of files) or from a Hugging Face stand-in named as
`mirror.registry`, sized against a fleet registered with a real in-process control plane. The
command runs as typer runs it, in a thread so the servers keep answering.

Every figure is checked against a hand calculation written out beside it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path

import gguf as gguf_lib
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.config.server import parse_server_config
from llmgw.files import write_secret_file
from llmgw.mirror.api import ApiAccess, api_app
from llmgw.mirror.fetcher import Manager
from llmgw.mirror.serve import manager_checksums, weights_app
from llmgw.protocol import GPU, PROTOCOL_VERSION, MemoryInfo, NodeInventory, Register
from llmgw.server.app import Server
from llmgw.server.control import sizing
from llmgw.testing.ports import free_port as _port
from llmgw.up import tiny_model as tm

GiB = 1 << 30
MiB = 1 << 20
runner = CliRunner()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "llmgw-mirror-plan-test"

# A Llama-3-8B-shaped config.json, as the repository has it (the fields sizing reads).
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
}
# By hand, for LLAMA_3_8B:
#   embeddings         128256 × 4096                          =   525,336,576
#   per layer: q, o    4096 × 32 heads × 128 (head_dim)        =    16,777,216 each
#              k, v    4096 × 8 kv heads × 128                 =     4,194,304 each
#              MLP     3 × 4096 × 14336 (gate, up, down)       =   176,160,768
#              norms   2 × 4096                                =         8,192
#              layer   16,777,216×2 + 4,194,304×2 + 176,160,768 + 8,192 = 218,112,000
#   32 layers          32 × 218,112,000                       = 6,979,584,000
#   final norm                                                 =         4,096
#   lm_head (untied)   128256 × 4096                          =   525,336,576
#   total              525,336,576 + 6,979,584,000 + 4,096 + 525,336,576 = 8,030,261,248
LLAMA_PARAMS = 8_030_261_248
#   KV cache at its 8192 tokens, 1 sequence, fp16: 2 × 32 layers × 8 kv heads × 128 × 8192 × 2 bytes
LLAMA_KV = 2 * 32 * 8 * 128 * 8192 * 2
assert LLAMA_KV == 1_073_741_824  # 1 GiB

# A Mixtral-8x7B-shaped config.json.
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
# By hand: embeddings and lm_head 2 × 32000 × 4096 = 262,144,000; per layer attention as Llama's
# 41,943,040, eight experts 8 × 3 × 4096 × 14336 = 1,409,286,144, the router 4096 × 8 = 32,768,
# norms 8,192: 1,451,270,144; × 32 = 46,440,644,608; + 262,144,000 + 4,096 (final norm)
MIXTRAL_PARAMS = 46_702_792_704
# Active: two experts a token, 2 × 176,160,768 = 352,321,536 in place of the eight:
# (41,943,040 + 352,321,536 + 32,768 + 8,192) × 32 + 262,144,000 + 4,096
MIXTRAL_ACTIVE = 12_879_925_248
# KV at its 32768 tokens: 2 × 32 × 8 × 128 × 32768 × 2 = 4 GiB
MIXTRAL_KV = 4 * GiB

# The fleet: what nvidia-smi reports for each card, in MiB.
H100 = 81559 * MiB  # "NVIDIA H100 80GB HBM3": class h100-80g
RTX4090 = 24564 * MiB  # "NVIDIA GeForce RTX 4090": class rtx4090-24g
CPU_NODE = 64 * GiB


def headroom(card: int) -> int:
    """The rule: 10% of the card (vLLM's gpu_memory_utilization 0.9) and 2 GiB, per GPU or CPU node."""
    return math.ceil(card * 0.10) + 2 * GiB


# 10% of 85,520,809,984 is 8,552,080,998.4 → 8,552,080,999, + 2,147,483,648
assert headroom(H100) == 10_699_564_647
# 10% of 25,757,220,864 is 2,575,722,086.4 → 2,575,722,087, + 2 GiB
assert headroom(RTX4090) == 4_723_205_735
# 10% of 68,719,476,736 is 6,871,947,673.6 → 6,871,947,674, + 2 GiB
assert headroom(CPU_NODE) == 9_019_431_322


# -- the pieces: a Hugging Face stand-in, the real mirror, a control plane with a fleet


class HuggingFace:
    """The Hub's shapes: model info with its commit, the tree with LFS sizes, files under
    /resolve/<revision>/ (Range answered, as the CDN does), a gated repository answering 401."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.asked: list[str] = []
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self.info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self.tree)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.*}", self.file)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def _repo(self, request: web.Request) -> tuple[str, web.Response | None]:
        self.asked.append(request.path_qs)
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            return repo, web.json_response({"error": "Repository not found"}, status=404)
        if repo in self.gated:
            return repo, web.json_response({"error": "Access to this repository is restricted"}, status=401)
        return repo, None

    async def info(self, request: web.Request) -> web.Response:
        repo, refused = self._repo(request)
        return refused or web.json_response({"id": repo, "sha": COMMIT, "gated": False})

    async def tree(self, request: web.Request) -> web.Response:
        repo, refused = self._repo(request)
        if refused:
            return refused
        files = self.repos[repo]
        return web.json_response(
            [
                {"type": "file", "path": p, "size": 135, "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b)}}
                for p, b in files.items()
            ]
        )

    async def file(self, request: web.Request) -> web.Response:
        repo, refused = self._repo(request)
        if refused:
            return refused
        body = self.repos[repo].get(request.match_info["path"])
        if body is None or request.match_info["rev"] not in ("main", COMMIT):
            return web.json_response({"error": "Entry not found"}, status=404)
        rng = request.headers.get("Range")
        if rng:
            start, end = (int(x) for x in rng.split("=")[1].split("-"))
            end = min(end, len(body) - 1)
            return web.Response(
                status=206, body=body[start : end + 1], headers={"Content-Range": f"bytes {start}-{end}/{len(body)}"}
            )
        return web.Response(body=body)


def write_gguf(path: Path, *, arch: str = "llama", tokens: int = 300, vocab_size: bool = True) -> Path:
    """A GGUF with a Llama header; without vocab_size its vocabulary is counted from the tokens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(128)
    w.add_block_count(4)
    w.add_feed_forward_length(512)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    if vocab_size:
        w.add_vocab_size(tokens)
    w.add_file_type(gguf_lib.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"token-number-{i:08d}" for i in range(tokens)])
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def vocab(tmp_path) -> Path:
    """A small vocabulary for the tiny model's writer (the sdist's is fetched from PyPI)."""
    path = tmp_path / "vocab.gguf"
    w = gguf_lib.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_token_scores([float(-i) for i in range(300)])
    w.add_token_types([2, 3, 3] + [1] * 297)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class Cluster:
    """The real mirror over ``root`` (both listeners), a Hugging Face stand-in as mirror.registry,
    and a control plane whose fleet is registered by ``node``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.root = tmp_path / "models"
        self.root.mkdir()
        self.hf = HuggingFace()

    async def start(self, models: list[dict] | None = None) -> Cluster:
        await self.hf.server.start_server()
        self.manager = Manager(self.root, hf_endpoint=self.hf.url)
        self.bytes = TestServer(weights_app(self.root, manager_checksums(self.manager)))
        await self.bytes.start_server()
        self.base = str(self.bytes.make_url("")).rstrip("/")
        token_file = self.tmp / "models.api-token"
        write_secret_file(token_file, TOKEN)
        self.api = TestServer(api_app(self.manager, self.root, self.base, ApiAccess(TOKEN, str(token_file))))
        await self.api.start_server()
        cfg = parse_server_config(
            {
                "listen": f"127.0.0.1:{_port()}",
                "admin_listen": f"127.0.0.1:{_port()}",
                "metrics_listen": None,
                "agent_listen": f"127.0.0.1:{_port()}",
                "agent_tls": None,
                "control": {"enabled": True},
                "engines": {"llamacpp": None},
                "auth": {"store": str(self.tmp / "gw.db")},
                "data_dir": str(self.tmp),
                "mirror": {
                    "api": str(self.api.make_url("")).rstrip("/"),
                    "token_file": str(token_file),
                    "registry": self.hf.url,
                },
                "models": models or [],
            }
        )
        self.server = Server(cfg)
        await self.server.start()
        return self

    async def close(self) -> None:
        await self.server.stop()
        await self.manager.close()
        for s in (self.api, self.bytes, self.hf.server):
            await s.close()

    def put(self, model: str, version: str, name: str, data: bytes | dict) -> Path:
        """A file copied into the mirror by hand, as docs/mirror.md allows."""
        path = self.root / model / version / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(json.dumps(data).encode() if isinstance(data, dict) else data)
        return path

    def node(self, node_id: str, *, gpus: list[tuple[str, int]] = (), memory: int = 512 * GiB) -> None:
        inv = NodeInventory(
            memory=MemoryInfo(total_bytes=memory),
            gpus=[GPU(index=i, name=name, memory_total_bytes=mem) for i, (name, mem) in enumerate(gpus)],
        )
        self.server.agents._apply_register(
            Register(node_id=node_id, protocol_version=PROTOCOL_VERSION, agent_version="t", inventory=inv), None
        )

    def fleet(self) -> None:
        self.node("gpu-8", gpus=[("NVIDIA H100 80GB HBM3", H100)] * 8)
        self.node("desk", gpus=[("NVIDIA GeForce RTX 4090", RTX4090)])
        self.node("cpu-1", memory=CPU_NODE)

    async def ctl(self, *args: str):
        admin = f"http://127.0.0.1:{self.server.config.admin_listen.port}"
        argv = ["ctl", "plan", *args, "--server", admin, "--token-file", str(self.server.admin_token_file)]
        return await asyncio.to_thread(runner.invoke, app, argv)

    async def plan(self, *args: str) -> dict:
        r = await self.ctl(*args, "--json")
        assert r.exit_code == 0, r.output
        return json.loads(r.output)


@pytest.fixture
async def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    await c.close()


def rows_by(plan: dict) -> dict[tuple[str, str], dict]:
    return {(r["precision"], r["pool"]): r for r in plan["rows"]}


# -- config.json in the mirror


async def test_a_llama_3_8b_config_in_the_mirror_gives_the_hand_calculated_figures_on_every_class(cluster):
    await cluster.start()
    cluster.put("llama3-8b", "v1", "config.json", LLAMA_3_8B)
    cluster.fleet()

    plan = await cluster.plan("llama3-8b/v1")
    a = plan["architecture"]
    assert a["parameters"] == LLAMA_PARAMS and a["active_parameters"] is None
    assert (a["layers"], a["hidden_size"], a["attention_heads"], a["kv_heads"], a["head_dim"]) == (32, 4096, 32, 8, 128)
    assert a["read_from"] == f"config.json of llama3-8b/v1 in the mirror ({cluster.base}/llama3-8b/v1/config.json)"
    assert a["checkpoint"] == "bf16" and plan["context"] == 8192 and plan["concurrency"] == 1
    rows = rows_by(plan)
    assert set(rows) == {
        *((p, c) for p in ("bf16", "fp8", "int8", "int4") for c in ("h100-80g", "rtx4090-24g")),
        *((p, "cpu-64g") for p in ("f16", "q8_0", "q4_k_m")),
    }

    # bf16 on an H100: 8,030,261,248 × 2 bytes = 16,060,522,496; + 1 GiB KV + the card's headroom
    # 10,699,564,647 = 27,833,828,967 on one GPU; 85,520,809,984 − that = 57,686,981,017 left.
    bf16 = rows[("bf16", "h100-80g")]
    assert bf16["weights_bytes"] == 16_060_522_496 == LLAMA_PARAMS * 2
    assert bf16["kv_cache_bytes"] == LLAMA_KV
    assert bf16["total_bytes"] == 27_833_828_967 == LLAMA_PARAMS * 2 + LLAMA_KV + headroom(H100)
    assert bf16["free_bytes"] == 57_686_981_017 == H100 - 27_833_828_967
    assert (bf16["fits"], bf16["gpus_per_replica"], bf16["tensor_parallel"], bf16["checkpoint"]) == (True, 1, 1, True)

    # bf16 on a 4090: 16,060,522,496 + 1,073,741,824 + 4,723,205,735 = 21,857,470,055 of 25,757,220,864.
    desk = rows[("bf16", "rtx4090-24g")]
    assert (desk["fits"], desk["gpus_per_replica"]) == (True, 1)
    assert desk["free_bytes"] == RTX4090 - 21_857_470_055 == 3_899_750_809

    # int4 (AWQ/GPTQ) keeps the embeddings and lm_head at 16 bits: 2 × 525,336,576 = 1,050,673,152
    # parameters × 2 bytes = 2,101,346,304; the other 6,979,588,096 at 4.15625 bits = 3,626,114,128;
    # 5,727,460,432 in all (the published AWQ checkpoint of Llama-3-8B is 5.73 GB).
    assert rows[("int4", "h100-80g")]["weights_bytes"] == 5_727_460_432
    assert (6_979_588_096 * 4.15625) / 8 == 3_626_114_128 and 2_101_346_304 + 3_626_114_128 == 5_727_460_432
    # fp8: 6,979,588,096 × 1 + 2,101,346,304 = 9,080,934,400
    assert rows[("fp8", "h100-80g")]["weights_bytes"] == 9_080_934_400

    # On the 64 GiB CPU node, llama.cpp's q4_k_m: 8,030,261,248 × 4.9 / 8 = 4,918,535,014.4 → …015;
    # + 1 GiB + 9,019,431,322 headroom = 15,011,708,161; 68,719,476,736 − that = 53,707,768,575.
    q4 = rows[("q4_k_m", "cpu-64g")]
    assert q4["weights_bytes"] == 4_918_535_015 and q4["kv_cache_bytes"] == LLAMA_KV
    assert q4["total_bytes"] == 15_011_708_161 and q4["free_bytes"] == 53_707_768_575
    assert (q4["fits"], q4["gpus_per_replica"], q4["gpu"]) == (True, 0, False)
    # q8_0: 34 bytes per 32 weights, 8,030,261,248 × 8.5 / 8 = 8,532,152,576
    assert rows[("q8_0", "cpu-64g")]["weights_bytes"] == 8_532_152_576

    # The table a person reads.
    r = await cluster.ctl("llama3-8b/v1")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == (
        "LlamaForCausalLM (llama), 8.03 billion parameters (8,030,261,248), read from config.json of "
        f"llama3-8b/v1 in the mirror ({cluster.base}/llama3-8b/v1/config.json)"
    )
    assert "32 layers, hidden 4096, 32 heads (8 KV heads of 128), vocab 128256" in lines[1]
    assert lines[2] == "context 8192 tokens × 1 sequence, KV cache fp16"
    header = next(line for line in lines if line.startswith("PRECISION"))
    assert header.split() == [
        "PRECISION",
        "CLASS",
        "FITS",
        "GPUS",
        "PER",
        "REPLICA",
        "WEIGHTS",
        "KV",
        "CACHE",
        "TOTAL",
        "FREE",
        "LEFT",
    ]
    bf16_line = next(line for line in lines if line.startswith("bf16 *") and "h100-80g" in line)
    assert bf16_line.split() == ["bf16", "*", "h100-80g", "yes", "1", "16", "GB", "1.1", "GB", "28", "GB", "58", "GB"]
    assert "* the precision of the checkpoint as it is" in lines
    assert any(line.startswith("TOTAL includes headroom on each GPU of 10% of the card") for line in lines)


async def test_a_long_context_for_many_sequences_needs_more_gpus_and_says_what_the_fleet_lacks(cluster):
    await cluster.start()
    cluster.put("llama3-8b", "v1", "config.json", LLAMA_3_8B)
    cluster.fleet()
    plan = await cluster.plan("llama3-8b/v1", "--context", "32768", "--concurrency", "4")
    assert (plan["context"], plan["concurrency"]) == (32768, 4)
    rows = rows_by(plan)
    # KV: 2 × 32 × 8 × 128 × 32768 × 4 × 2 bytes = 16 GiB
    kv = 2 * 32 * 8 * 128 * 32768 * 4 * 2
    assert kv == 16 * GiB and rows[("bf16", "h100-80g")]["kv_cache_bytes"] == kv
    # One H100 still holds it: 16,060,522,496 + 17,179,869,184 + 10,699,564,647 = 43,939,956,327.
    assert rows[("bf16", "h100-80g")]["gpus_per_replica"] == 1
    assert rows[("bf16", "h100-80g")]["total_bytes"] == 43_939_956_327
    # A 4090 does not: per GPU at tp 2, 8,030,261,248 + 8 GiB (4 of the 8 KV heads) + 4,723,205,735
    # = 21,343,401,575 ≤ 25,757,220,864, but the desk has one card.
    desk = rows[("bf16", "rtx4090-24g")]
    assert desk["fits"] is False and desk["gpus_per_replica"] == 2 and desk["free_bytes"] is None
    assert desk["reason"] == "needs 2 GPUs; the fleet has 1 node with at most 1 of them"
    assert desk["total_bytes"] == 16_060_522_496 + kv + 2 * headroom(RTX4090)
    # fp8 KV halves it: 8 GiB
    plan8 = await cluster.plan("llama3-8b/v1", "--context", "32768", "--concurrency", "4", "--kv-cache", "fp8")
    assert rows_by(plan8)[("bf16", "h100-80g")]["kv_cache_bytes"] == 8 * GiB
    # llama.cpp's nearest to an fp8 cache is q8_0, 34 bytes per 32: 16 GiB × 8.5 / 16
    assert rows_by(plan8)[("q4_k_m", "cpu-64g")]["kv_cache_bytes"] == 8 * GiB * 34 // 32

    r = await cluster.ctl("llama3-8b/v1", "--context", "32768", "--concurrency", "4")
    assert "  bf16 on rtx4090-24g: needs 2 GPUs; the fleet has 1 node with at most 1 of them" in r.output
    assert "context 32768 tokens × 4 sequences, KV cache fp16" in r.output


async def test_a_mixtral_config_counts_every_expert_and_splits_it_over_two_h100s(cluster):
    await cluster.start()
    cluster.put("mixtral", "2025-01", "config.json", MIXTRAL)
    cluster.fleet()
    plan = await cluster.plan("mixtral")  # one version: the model's name is enough
    a = plan["architecture"]
    assert (a["parameters"], a["active_parameters"]) == (MIXTRAL_PARAMS, MIXTRAL_ACTIVE)
    assert (a["experts"], a["experts_per_token"]) == (8, 2) and plan["context"] == 32768
    rows = rows_by(plan)
    bf16 = rows[("bf16", "h100-80g")]
    # 46,702,792,704 × 2 = 93,405,585,408 does not fit one card; on two each holds half the weights,
    # 4 of the 8 KV heads (2 GiB) and its headroom: 46,702,792,704 + 2 GiB + 10,699,564,647
    # = 59,549,840,999 ≤ 85,520,809,984.
    assert bf16["weights_bytes"] == 93_405_585_408 and bf16["kv_cache_bytes"] == MIXTRAL_KV
    assert (bf16["fits"], bf16["gpus_per_replica"], bf16["tensor_parallel"], bf16["nodes"]) == (True, 2, 2, 1)
    assert bf16["free_bytes"] == 2 * H100 - (93_405_585_408 + MIXTRAL_KV + 2 * headroom(H100))
    # On the one-card desk: 8 cards would do (93,405,585,408 / 8 + 4 GiB / 8 + 4,723,205,735 per card).
    assert rows[("bf16", "rtx4090-24g")]["reason"] == "needs 8 GPUs; the fleet has 1 node with at most 1 of them"
    r = await cluster.ctl("mixtral")
    assert "46.7 billion parameters (46,702,792,704), 12.9 billion active per token" in r.output
    assert "8 experts, 2 per token" in r.output


async def test_a_catalog_model_is_read_where_its_source_lies_in_the_mirror(cluster):
    await cluster.start(
        models=[
            {
                "name": "llama",
                "source": "http://models.internal:8081/llama3-8b/v1/",  # another name for the mirror
                "scaling": {"min": 0},
                "profiles": [{"engine": "vllm", "gpu_class": "h100-80g"}],
            },
            {
                "name": "on-disk",
                "source": "/srv/weights/x.gguf",
                "scaling": {"min": 0},
                "profiles": [{"engine": "llamacpp"}],
            },
        ]
    )
    cluster.put("llama3-8b", "v1", "config.json", LLAMA_3_8B)
    cluster.put("llama3-8b", "v1", "model-00001-of-00004.safetensors", b"\0" * 16)
    plan = await cluster.plan("llama")
    assert plan["architecture"]["parameters"] == LLAMA_PARAMS
    assert plan["architecture"]["read_from"].startswith("config.json of llama3-8b/v1 in the mirror")
    r = await cluster.ctl("on-disk")
    assert r.exit_code == 1
    assert (
        "on-disk's source is a path on the nodes (/srv/weights/x.gguf), which the control plane cannot read" in r.output
    )


# -- GGUF


async def test_a_gguf_in_the_mirror_is_sized_by_its_file_and_its_header(cluster, vocab):
    await cluster.start()
    path = tm.write_tiny_model(cluster.root / "tiny" / "v1" / "tiny.gguf", vocab=vocab)
    cluster.fleet()
    plan = await cluster.plan("tiny/v1")
    a = plan["architecture"]
    assert a["format"] == "gguf" and a["name"] == "llama" and a["checkpoint"] == "f16"
    assert a["file_bytes"] == path.stat().st_size and a["max_context"] == tm.CONTEXT_LENGTH == 8192
    # By hand (64 wide, 2 layers, 4 heads of 16, 4 KV heads, MLP 192, 300 tokens, output untied):
    # embeddings and output 2 × 300 × 64 = 38,400; a layer's q, k, v, o 4 × 64 × 64 = 16,384,
    # MLP 3 × 64 × 192 = 36,864, norms 128: 53,376, × 2 = 106,752; final norm 64 → 145,216
    assert a["parameters"] == 145_216
    # One row per class, in the file's own type; the weights are the file.
    assert {(r["precision"], r["pool"]) for r in plan["rows"]} == {
        ("f16", "h100-80g"),
        ("f16", "rtx4090-24g"),
        ("f16", "cpu-64g"),
    }
    for r in plan["rows"]:
        # KV: 2 × 2 layers × 4 KV heads × 16 × 8192 tokens × 2 bytes = 4,194,304
        assert r["weights_bytes"] == path.stat().st_size and r["kv_cache_bytes"] == 4_194_304
        assert r["engine"] == "llamacpp" and r["fits"] is True and r["checkpoint"] is True
    cpu = rows_by(plan)[("f16", "cpu-64g")]
    assert cpu["free_bytes"] == CPU_NODE - (path.stat().st_size + 4_194_304 + headroom(CPU_NODE))
    r = await cluster.ctl("tiny/v1/tiny.gguf")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(
        f"llama, 145,216 parameters, read from the GGUF header of tiny/v1/tiny.gguf in the mirror ({cluster.base}/"
    )


async def test_a_gguf_header_is_read_on_to_its_vocabulary_when_it_states_no_vocab_size(cluster):
    await cluster.start()
    # 40,000 tokens of 21 characters: about 1.2 MB of vocabulary, past the first 256 KB read.
    path = write_gguf(cluster.root / "big-vocab" / "v1" / "m-q8_0.gguf", tokens=40_000, vocab_size=False)
    assert path.stat().st_size > 1_000_000
    plan = await cluster.plan("big-vocab/v1")
    a = plan["architecture"]
    assert a["vocab_size"] == 40_000 and a["checkpoint"] == "q8_0"
    # 2 × 40,000 × 128 + 4 × (128 × 8 × 16 × 2 + 128 × 2 × 16 × 2 + 3 × 128 × 512 + 2 × 128) + 128
    assert a["parameters"] == 10_240_000 + 4 * (32_768 + 8_192 + 196_608 + 256) + 128
    # No nodes: the figures alone, and the note saying so.
    assert plan["rows"] == [] and "no nodes have registered" in plan["notes"][0]
    # 2 × 4 layers × 2 KV heads × 16 × 4096 tokens × 2 bytes
    assert plan["figures"][0]["kv_cache_bytes"] == 2 * 4 * 2 * 16 * 4096 * 2
    r = await cluster.ctl("big-vocab/v1")
    assert "PRECISION  ENGINE    WEIGHTS  KV CACHE" in r.output
    assert "note: no nodes have registered, so nothing is fitted; the figures are below" in r.output


# -- Hugging Face through mirror.registry


async def test_hugging_face_is_read_through_the_registry_only(cluster):
    await cluster.start()
    cluster.hf.repos["acme/llama-8b"] = {"config.json": json.dumps(LLAMA_3_8B).encode()}
    cluster.hf.repos["acme/tiny-GGUF"] = {"tiny-q8_0.gguf": write_gguf(cluster.tmp / "t.gguf").read_bytes()}
    cluster.hf.repos["acme/gated"] = {"config.json": b"{}"}
    cluster.hf.gated.add("acme/gated")
    cluster.node("cpu-1", memory=CPU_NODE)

    plan = await cluster.plan("hf:acme/llama-8b")
    assert plan["architecture"]["parameters"] == LLAMA_PARAMS
    assert plan["architecture"]["read_from"] == f"config.json of hf:acme/llama-8b on {cluster.hf.url}"
    assert cluster.hf.asked == ["/acme/llama-8b/resolve/main/config.json"]
    # A name in ORG/NAME form that is neither in the catalog nor in the mirror is looked up there too.
    assert (await cluster.plan("acme/llama-8b"))["architecture"]["parameters"] == LLAMA_PARAMS

    # A GGUF repository: no config.json, so its one GGUF's header, read by Range.
    plan = await cluster.plan("hf:acme/tiny-GGUF")
    assert plan["architecture"]["format"] == "gguf" and plan["architecture"]["checkpoint"] == "q8_0"
    assert (
        plan["architecture"]["read_from"] == f"the GGUF header of hf:acme/tiny-GGUF/tiny-q8_0.gguf on {cluster.hf.url}"
    )

    r = await cluster.ctl("hf:acme/gated")
    assert r.exit_code == 1
    assert "hf:acme/gated is gated or private on" in r.output and "reads it without a token" in r.output
    r = await cluster.ctl("acme/nothing-here")
    assert r.exit_code == 1 and "answered 404" in r.output
    assert "no model acme/nothing-here in the catalog; none in the mirror (M, M/V or M/V/FILE); " in r.output
    assert f"hf:acme/nothing-here was not found on {cluster.hf.url}; check the name (ORG/NAME)" in r.output


async def test_a_mirrored_version_without_a_config_reads_the_repository_it_was_fetched_from_at_its_commit(cluster):
    await cluster.start()
    cluster.hf.repos["acme/llama-8b"] = {
        "config.json": json.dumps(LLAMA_3_8B).encode(),
        "model.safetensors": b"\0" * 1000,
    }
    # The real fetcher brings the weights alone from the stand-in, recording hf:…@<commit> as their source.
    await cluster.manager.fetch("hf:acme/llama-8b/model.safetensors", "llama-st", "v1")
    assert (await cluster.manager.wait("llama-st", "v1")).state == "present"
    cluster.hf.asked.clear()
    plan = await cluster.plan("llama-st/v1")
    assert plan["architecture"]["parameters"] == LLAMA_PARAMS
    assert plan["architecture"]["read_from"] == (
        f"config.json of hf:acme/llama-8b at {COMMIT[:12]} on {cluster.hf.url}, the source of llama-st/v1's model.safetensors"
    )
    assert cluster.hf.asked == [f"/acme/llama-8b/resolve/{COMMIT}/config.json"]


# -- what is refused


async def test_a_model_found_nowhere_is_said_plainly(cluster):
    await cluster.start()
    r = await cluster.ctl("nope")
    assert r.exit_code == 1
    assert (
        "answered 404: no model nope in the catalog; none in the mirror (M, M/V or M/V/FILE); "
        "and it is not a Hugging Face name (hf:ORG/NAME)"
    ) in r.output
    cluster.put("readme-only", "v1", "README.md", b"hello")
    r = await cluster.ctl("readme-only/v1")
    assert r.exit_code == 1 and "holds no config.json and no GGUF file" in r.output
    cluster.put("broken", "v1", "config.json", {"model_type": "llama", "hidden_size": 4096})
    r = await cluster.ctl("broken/v1")
    assert r.exit_code == 1
    assert "config.json does not say num_hidden_layers, num_attention_heads, so the model cannot be sized" in r.output
    assert cluster.hf.asked == []  # nothing found in ORG/NAME form was asked of Hugging Face


# -- a fleet without GPUs


async def test_a_fleet_of_cpu_nodes_is_fitted_in_their_memory_with_llamacpps_types(cluster):
    await cluster.start()
    cluster.put("llama3-8b", "v1", "config.json", LLAMA_3_8B)
    cluster.node("cpu-small", memory=16 * GiB)
    cluster.node("cpu-big", memory=CPU_NODE)
    plan = await cluster.plan("llama3-8b/v1")
    rows = rows_by(plan)
    assert set(rows) == {(p, c) for p in ("f16", "q8_0", "q4_k_m") for c in ("cpu-16g", "cpu-64g")}
    # 16 GiB = 17,179,869,184; headroom 1,717,986,919 + 2 GiB = 3,865,470,567; q4_k_m needs
    # 4,918,535,015 + 1 GiB + 3,865,470,567 = 9,857,747,406: fits; f16 needs 16,060,522,496 + … : not.
    assert rows[("q4_k_m", "cpu-16g")]["free_bytes"] == 16 * GiB - 9_857_747_406
    f16 = rows[("f16", "cpu-16g")]
    short = 16_060_522_496 + LLAMA_KV + 3_865_470_567 - 16 * GiB
    assert f16["fits"] is False and f16["reason"] == f"a cpu-16g node is {short / 1e9:.1f} GB short"
    assert rows[("f16", "cpu-64g")]["fits"] is True
    r = await cluster.ctl("llama3-8b/v1")
    line = next(x for x in r.output.splitlines() if x.startswith("q4_k_m") and "cpu-16g" in x)
    assert line.split()[:4] == ["q4_k_m", "cpu-16g", "yes", "CPU"]


# -- the arithmetic alone


def test_latent_attention_caches_the_latent_and_counts_deepseek_v3_at_671_billion():
    a = sizing.from_config(
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "vocab_size": 129280,
            "tie_word_embeddings": False,
        }
    )
    # DeepSeek's own figures: 671B in all, 37B active (the multi-token-prediction layer left out).
    assert round(a.parameters / 1e9) == 671 and 37.5e9 < a.active_parameters < 37.6e9
    # KV per token: 61 layers × (512 + 64), not 2 × 128 heads × 128
    assert a.kv_per_token == 61 * 576 and a.kv_split == "copied"


def test_qwen2_counts_its_qkv_biases_and_an_untold_tie_counts_lm_head():
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
    }
    a = sizing.from_config(cfg)
    # Qwen2.5-7B: 7.62 billion (the model card's 7.61B, with its q/k/v biases)
    assert a.parameters == 7_615_616_512 and not a.tied
    assert any("tie_word_embeddings is not stated" in n for n in a.notes)
    tied = sizing.from_config({**cfg, "tie_word_embeddings": True})
    assert a.parameters - tied.parameters == 152064 * 3584


DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "max_position_embeddings": 163840,
}


def test_a_replica_too_large_for_one_node_spans_whole_nodes_as_a_profile_says_tp_and_nodes():
    a = sizing.from_config(DEEPSEEK_V3)
    two_nodes = [sizing.Machine(f"gpu-{i}", (("h100-80g", H100),) * 8) for i in range(2)]
    p = sizing.plan(a, two_nodes)
    rows = {f.precision: f for f in p.fits}
    # fp8: the embeddings and lm_head (2 × 129280 × 7168 = 1,853,358,080) at 2 bytes, the other
    # 669,173,046,272 at 1: 672,879,762,432. KV: 61 layers × (512 + 64) × 163840 tokens × 2 bytes
    # = 11,513,364,480, held whole on every rank. On 16 GPUs each needs 672,879,762,432 / 16
    # + 11,513,364,480 + 10,699,564,647 = 64,267,914,279 ≤ 85,520,809,984; on 8 it would be 106 GB.
    fp8 = rows["fp8"]
    assert fp8.weights_bytes == 672_879_762_432 and (fp8.fits, fp8.tp, fp8.nodes) == (True, 16, 2)
    assert fp8.kv_cache_bytes == 16 * 11_513_364_480
    assert fp8.free_bytes == 16 * H100 - (672_879_762_432 + 16 * 11_513_364_480 + 16 * headroom(H100))
    # bf16: 1,342,052,808,704 bytes; 16 GPUs leave each 83.9 GB of weights: it needs 32 (4 nodes).
    bf16 = rows["bf16"]
    assert (bf16.fits, bf16.tp, bf16.nodes) == (False, 32, 4)
    assert bf16.reason == "needs 32 GPUs (8 on each of 4 nodes); the fleet has 2 nodes with at most 8 of them"
    # Asked for more context than the model has, it says so.
    assert "more than the model's own maximum of 163840" in sizing.plan(a, two_nodes, context=200_000).notes[-1]


async def test_a_mirror_that_cannot_be_asked_still_lets_hugging_face_names_be_planned_and_is_said(cluster):
    await cluster.start()
    cluster.hf.repos["acme/llama-8b"] = {"config.json": json.dumps(LLAMA_3_8B).encode()}
    await cluster.api.close()  # the management API is gone; the byte port is not needed for this
    assert (await cluster.plan("acme/llama-8b"))["architecture"]["parameters"] == LLAMA_PARAMS
    r = await cluster.ctl("nope")
    assert (
        r.exit_code == 1 and "answered 503: no model nope in the catalog; the mirror could not be asked (" in r.output
    )


def test_a_gguf_too_large_for_one_gpu_says_llamacpp_runs_on_one():
    # A 30 GB GGUF (its header as from_gguf reads it) on a 24 GB card: llama.cpp takes no tp.
    meta = {
        "general.architecture": "llama",
        "general.file_type": 15,
        "llama.block_count": 32,
        "llama.embedding_length": 4096,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
        "llama.context_length": 8192,
    }
    a = sizing.from_gguf(meta, 30_000_000_000)
    assert a.checkpoint == "q4_k_m" and a.parameters is None  # no feed_forward_length: not counted
    p = sizing.plan(a, [sizing.Machine("desk", (("rtx4090-24g", RTX4090),))])
    (row,) = p.fits
    # 30,000,000,000 + 1 GiB (KV at 8192) + 4,723,205,735 − 25,757,220,864 = 10,039,726,695 short
    assert (row.fits, row.tp, row.precision) == (False, 1, "q4_k_m")
    assert row.reason == "llama.cpp runs a replica on one GPU, and one rtx4090-24g is 10.0 GB short"
