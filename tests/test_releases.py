"""The current official releases: V4-Flash-0731, V4-Pro-0813, V4-*-DSpark (a 3-stage DSpark draft under
``mtp.*``, ``dspark_*`` config keys, three trailing zero ratios) and NVIDIA's NVFP4 ports of them (NVFP4
main-stack experts, MXFP4 draft experts, ModelOpt keys in ``quantization_config``).

Facts checked here come from ../shared/spec/dspark-and-0731.md §1-§3: tensor names, counts and shapes of
the draft, the release config keys, the ports' per-layer expert formats."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_helpers import clone_dir, edit_json, rewrite_shard, shard_of, small

from dsv4 import LLM, SamplingParams, cli
from dsv4.checkpoint import build_tiny_tensors, load_checkpoint, save_checkpoint
from dsv4.checkpoint import synthetic as syn
from dsv4.checkpoint.loader import CheckpointError, open_checkpoint
from dsv4.checkpoint.schema import expected_specs
from dsv4.config import ConfigError, ModelConfig, preset, with_draft
from dsv4.server.chat_encoding import (BOS, REASONING_EFFORT_MAX_0731_TEXT, REASONING_EFFORT_MAX_TEXT,
                                       detect_effort_profile, encode_messages)

E8M0, FP8, BF16, F32 = torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.bfloat16, torch.float32
LAYOUTS = ("official", "hf", "modelopt-nvfp4")


# ----------------------------------------------------------------------------- the release inventory
@pytest.mark.parametrize("name,count,main,rank,targets,ratios", [
    ("flash", 4705, 67612, 256, [40, 41, 42], 46),
    ("pro", 7009, 142773, 512, [58, 59, 60], 64),
])
def test_dspark_inventory_of_the_releases(name, count, main, rank, targets, ratios):
    """spec §2.1: 4,705 (Flash-0731) / 7,009 (Pro-0813) mtp.* tensors, the main stack unchanged;
    §1: the root config keys and the trailing zeros, num_nextn_predict_layers left at 1."""
    cfg = preset(name, draft="dspark")
    d = cfg.hidden_size
    hf = cfg.to_hf()
    assert (hf["dspark_block_size"], hf["dspark_markov_rank"], hf["dspark_noise_token_id"],
            hf["dspark_target_layer_ids"]) == (5, rank, 128799, targets)
    assert len(hf["compress_ratios"]) == ratios and hf["compress_ratios"][-4:] == [4, 0, 0, 0]
    assert hf["num_nextn_predict_layers"] == 1 and ModelConfig.from_hf(hf) == cfg
    specs = expected_specs(cfg, "mxfp4")
    draft = {n: s for n, s in specs.items() if n.startswith("mtp.")}
    assert len(draft) == count and len(specs) - len(draft) == main
    assert {n: s for n, s in specs.items() if not n.startswith("mtp.")} == expected_specs(preset(name), "mxfp4",
                                                                                          draft=False)
    per_stage = (len(draft) - 10) // 3
    assert per_stage == {"flash": 1565, "pro": 2333}[name]
    shape = {n: (s.shape, s.dtype) for n, s in draft.items()}
    assert shape["mtp.0.main_proj.weight"] == ((d, 3 * d), FP8)
    assert shape["mtp.0.main_proj.scale"] == ((d // 128, 3 * d // 128), E8M0)
    assert shape["mtp.0.main_norm.weight"] == ((d,), BF16) and shape["mtp.2.norm.weight"] == ((d,), BF16)
    assert shape["mtp.2.hc_head_fn"] == ((4, 4 * d), F32) and shape["mtp.2.hc_head_scale"] == ((1,), F32)
    for w in ("markov_w1", "markov_w2"):
        assert shape[f"mtp.2.markov_head.{w}.weight"] == ((129280, rank), BF16)
    assert shape["mtp.2.confidence_head.proj.weight"] == ((1, d + rank), BF16)
    for s in range(3):                         # each stage: a full ratio-0, score-routed block
        p = f"mtp.{s}."
        assert p + "ffn.gate.bias" in draft and p + "ffn.gate.tid2eid" not in draft
        assert not any(n.startswith(p + "attn.compressor.") or n.startswith(p + "attn.indexer.") for n in draft)
        assert shape[p + "ffn.experts.0.w1.weight"] == ((cfg.moe_intermediate_size, d // 2), torch.int8)
        assert f"{p}ffn.experts.{cfg.n_routed_experts - 1}.w3.scale" in draft
    assert not any(k in n for n in draft for k in ("e_proj", "h_proj", "enorm", "hnorm"))
    # make-synthetic --model NAME --draft dspark at full depth writes exactly this config
    assert syn.synthetic_config(name, cfg.num_hidden_layers, draft="dspark") == cfg


def test_release_config_keys_and_their_errors():
    good = preset("flash", draft="dspark").to_hf()
    cfg = ModelConfig.from_hf(good)
    assert (cfg.draft_kind, cfg.num_draft_stages, cfg.num_layers_total) == ("dspark", 3, 46)
    assert preset("flash").draft_kind == "mtp" and preset("flash").num_draft_stages == 1

    def bad(edit, msg):
        d = json.loads(json.dumps(good))
        edit(d)
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_hf(d)
    bad(lambda d: d.pop("dspark_markov_rank"), r"dspark_markov_rank: a DSpark config needs all of")
    bad(lambda d: d.update(compress_ratios=d["compress_ratios"][:44]),
        r"compress_ratios: needs num_hidden_layers \+ 3 \(DSpark stages = len\(dspark_target_layer_ids\)\) = 46 "
        r"entries.*found 44")
    bad(lambda d: d.update(compress_ratios=d["compress_ratios"][:45] + [4]),
        r"compress_ratios: the 3 draft-stage entries after num_hidden_layers=43 must be 0")
    bad(lambda d: d.update(dspark_target_layer_ids=[41, 42, 43]), r"dspark_target_layer_ids: every id must be a main")
    bad(lambda d: d.update(dspark_target_layer_ids=[42, 42, 41]), r"dspark_target_layer_ids: ids must be distinct")
    bad(lambda d: d.update(dspark_block_size=1), r"dspark_block_size: must be an integer >= 2")
    bad(lambda d: d.update(dspark_noise_token_id=129280), r"dspark_noise_token_id: must be a token id")
    bad(lambda d: d.update(dspark_mystery=1), r"unknown config field\(s\): dspark_mystery")
    # fewer stages: the trailing zeros follow len(dspark_target_layer_ids), not num_nextn_predict_layers
    two = json.loads(json.dumps(good))
    two.update(dspark_target_layer_ids=[41, 42], compress_ratios=good["compress_ratios"][:45])
    assert ModelConfig.from_hf(two).num_draft_stages == 2
    # NVIDIA's port form: ModelOpt keys inside quantization_config
    q = dict(good["quantization_config"], quant_algo="MIXED_PRECISION", moe_quant_algo="NVFP4", group_size=16,
             kv_cache_quant_algo=None, ignore=["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"],
             quantized_layers={f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4", "group_size": 16}
                               for i in range(43)},
             config_groups={"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 4,
                                                                           "group_size": 16}}})
    port = ModelConfig.from_hf(dict(good, quantization_config=q))
    assert port.nvfp4_experts and ModelConfig.from_hf(port.to_hf()) == port
    bad(lambda d: d.update(quantization_config=dict(q, group_size=32)), r"quantization_config\.group_size")
    bad(lambda d: d.update(quantization_config=dict(q, kv_cache_quant_algo="FP8")), r"kv_cache_quant_algo")
    bad(lambda d: d.update(quantization_config=dict(q, quantized_layers={"layers.0.ffn.experts": {
        "quant_algo": "MXFP8"}})), r"quantized_layers\.layers\.0\.ffn\.experts: only NVFP4")
    bad(lambda d: d.update(quantization_config=dict(q, bogus=1)), r"quantization_config: unknown field\(s\) bogus")


# ----------------------------------------------------------------------------- tiny checkpoints
@pytest.fixture(scope="module")
def tensors():
    """Canonical tensors per draft; the main stack is the same draw in all three (the draft comes last)."""
    return {d: build_tiny_tensors(small(d), 5, draft=d != "none") for d in ("none", "mtp", "dspark")}


@pytest.fixture(scope="module")
def ckpt(tensors, tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return {(d, lay): save_checkpoint(t, small(d), root / f"{d}-{lay}", layout=lay, shards=2, tokenizer=False)
            for d, t in tensors.items() for lay in LAYOUTS}


def test_same_main_stack_whatever_the_draft(tensors):
    main = {k: v for k, v in tensors["dspark"].items() if not k.startswith("mtp.")}
    assert list(main) == list(tensors["none"])
    assert all(torch.equal(main[k].view(torch.uint8) if main[k].dtype.itemsize == 1 else main[k],
                           tensors["none"][k].view(torch.uint8) if main[k].dtype.itemsize == 1 else tensors["none"][k])
               for k in main)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("draft", ("none", "mtp", "dspark"))
def test_every_layout_and_draft_loads(ckpt, tensors, draft, layout):
    r = open_checkpoint(ckpt[(draft, layout)])
    stages = {"none": 0, "mtp": 1, "dspark": 3}[draft]
    assert (r.layout, r.draft, r.config.num_draft_stages if draft != "none" else 0) == (layout, draft, stages)
    main = "nvfp4" if layout == "modelopt-nvfp4" else "mxfp4"
    # NVFP4 ports: only the main stack's experts are NVFP4; mtp.* stays MXFP4 (spec §3)
    assert r.expert_format == main
    assert r.expert_formats == {**{f"layers.{i}.": main for i in range(6)},
                                **{f"mtp.{j}.": "mxfp4" for j in range(stages)}}
    names = [n for n in r.names if n.startswith("mtp.")]
    assert sorted(names) == sorted(n for n in tensors[draft] if n.startswith("mtp."))
    if draft == "dspark":
        assert "DSpark draft (3 stages on layers [3, 4, 5], block 5, markov rank 32, mxfp4 experts)" in \
            r.describe_draft()
        ck = load_checkpoint(ckpt[(draft, layout)], progress=False)
        for n in ("mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight", "mtp.1.ffn.experts.3.w2.weight"):
            assert torch.equal(ck.tensors[n].view(torch.uint8), tensors[draft][n].view(torch.uint8)), n


def _greedy(path):
    llm = LLM(path, log=False, kv_cache_memory="32MiB", max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [0, 34, 47, 100, 200, 7]}, {"prompt_token_ids": [0, 9, 300]}], sp)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dspark_checkpoint_serves_the_main_models_tokens(ckpt, layout):
    """A DSpark checkpoint serves at once without its draft: the same greedy tokens as the main
    model without mtp.*, in every layout."""
    want = _greedy(ckpt[("none", layout)])
    assert _greedy(ckpt[("dspark", layout)]) == want
    if layout == "official":
        assert _greedy(ckpt[("mtp", "official")]) == want


# ----------------------------------------------------------------------------- damaged drafts
def _edit_tensors(d, name, fn):
    """Apply ``fn`` to the tensors of the shard holding ``name``; the index then maps what it holds."""
    f = shard_of(d, name)
    rewrite_shard(f, fn)
    held, base = set(load_file(f)), os.path.basename(f)

    def reindex(idx):
        idx["weight_map"] = {**{k: v for k, v in idx["weight_map"].items() if v != base}, **{k: base for k in held}}
    edit_json(os.path.join(d, "model.safetensors.index.json"), reindex)


def test_damaged_dspark_drafts_are_named(ckpt, tmp_path):
    src = ckpt[("dspark", "official")]
    # one tensor missing
    d = clone_dir(src, tmp_path / "missing")
    name = "mtp.1.attn.wkv.scale"
    _edit_tensors(d, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' is missing (expected F8_E8M0 [4, 2]")
                       + r".*draft dspark"):
        open_checkpoint(d)
    # one misshapen
    d = clone_dir(src, tmp_path / "shape")
    name = "mtp.2.markov_head.markov_w2.weight"
    _edit_tensors(d, name, lambda t: t.update({name: t[name][:, :16].contiguous()}))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' has shape [512, 16], expected [512, 32] = "
                                                        "[vocab_size, dspark_markov_rank]") +
                       r".*dim 1 is 16, expected 32 = dspark_markov_rank"):
        open_checkpoint(d)
    # a stage missing: every mtp.2.* tensor gone
    d = clone_dir(src, tmp_path / "stage")
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        stage2 = [n for n in json.load(fh)["weight_map"] if n.startswith("mtp.2.")]
    for f in {shard_of(d, n) for n in stage2}:
        rewrite_shard(f, lambda t: [t.pop(n, None) for n in stage2])
    edit_json(os.path.join(d, "model.safetensors.index.json"), lambda idx: [idx["weight_map"].pop(n) for n in stage2])
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.2\.attn_norm\.weight' is missing.*draft dspark"):
        open_checkpoint(d)
    # the config's trailing zeros disagree with the stage count
    d = clone_dir(src, tmp_path / "zeros")
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(compress_ratios=c["compress_ratios"][:-1]))
    with pytest.raises(CheckpointError, match=r"config\.json: compress_ratios: needs num_hidden_layers \+ 3 "
                                              r"\(DSpark stages"):
        open_checkpoint(d)
    # DSpark tensors under an April config, and an April MTP block under a DSpark config
    d = clone_dir(src, tmp_path / "april-config")
    edit_json(os.path.join(d, "config.json"), lambda c: [c.pop(k) for k in ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id",
                                                  "dspark_target_layer_ids")] + [c.update(
                                                      compress_ratios=c["compress_ratios"][:-2])])
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.main_proj\.(weight|scale)' belongs to a DSpark draft.*"
                                              r"has no dspark_\* keys"):
        open_checkpoint(d)
    d = clone_dir(ckpt[("mtp", "official")], tmp_path / "dspark-config")
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(small("dspark").to_hf()))
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.(e_proj|h_proj|enorm|hnorm)\..*' belongs to an April "
                                              r"MTP block, but .*config\.json announces a DSpark draft"):
        open_checkpoint(d)


def test_nvfp4_port_with_draft_experts_in_mxfp4_is_checked_per_tensor(ckpt, tmp_path):
    """The port's mtp.* experts are MXFP4 (int8 + e8m0 .scale): an NVFP4 expert tensor there, or an
    MXFP4 one in the main stack, is refused naming it."""
    d = clone_dir(ckpt[("dspark", "modelopt-nvfp4")], tmp_path / "nv")
    name = "mtp.0.ffn.experts.2.w1.scale"
    _edit_tensors(d, name, lambda t: t.update({name.replace(".scale", ".weight_scale"): torch.zeros(128, 16, dtype=FP8)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp\.0\.ffn\.experts\.2\.w1\.weight_scale'"):
        open_checkpoint(d)


# ----------------------------------------------------------------------------- writers
def test_make_synthetic_writes_the_0731_layout(tmp_path, monkeypatch, capsys):
    """`make-synthetic --model flash --draft dspark`: the CLI asks for the DSpark config and writes the
    port's layout (here at reduced dims: the full 0731 inventory is checked from the schema above)."""
    seen = {}

    def reduced(preset_name, layers, experts, draft="mtp"):
        seen["args"] = (preset_name, layers, experts, draft)
        base = preset("tiny", vocab_size=512, n_routed_experts=4, num_experts_per_tok=2)
        return with_draft(base, draft, markov_rank=16, noise_token_id=500)
    monkeypatch.setattr(syn, "synthetic_config", reduced)
    out = tmp_path / "mo"
    rc = cli.main(["make-synthetic", str(out), "--model", "flash", "--layers", "6", "--draft", "dspark",
                   "--layout", "modelopt-nvfp4", "--device", "cpu", "--max-shard-size", "8MB"])
    assert rc == 0 and seen["args"] == ("flash", 6, None, "dspark"), capsys.readouterr().err
    r = open_checkpoint(str(out))
    assert (r.layout, r.draft, r.expert_formats["layers.5."], r.expert_formats["mtp.2."]) == \
        ("modelopt-nvfp4", "dspark", "nvfp4", "mxfp4")
    with open(out / "config.json") as fh:
        c = json.load(fh)
    assert c["dspark_target_layer_ids"] == [3, 4, 5] and c["num_nextn_predict_layers"] == 1
    assert "mtp.*" in c["quantization_config"]["ignore"]
    assert rc == 0 and cli.main(["make-tiny", str(tmp_path / "none"), "--draft", "none"]) == 0
    assert open_checkpoint(str(tmp_path / "none")).draft == "none"


# ----------------------------------------------------------------------------- chat encoding of 0731
def test_reasoning_effort_profiles():
    msgs = [{"role": "user", "content": "Q"}]

    def enc(effort, profile):
        return encode_messages(msgs, thinking=True, reasoning_effort=effort, effort_profile=profile)
    tail = "<｜User｜>Q<｜Assistant｜><think>"
    # April preview: only "max" adds a paragraph
    assert [enc(e, "preview") for e in ("low", "high", "max")] == [BOS + tail, BOS + tail,
                                                                   BOS + REASONING_EFFORT_MAX_TEXT + tail]
    # 0731: low (default) none, high = April's max paragraph, max = the new one; xhigh -> max
    assert [enc(e, "0731") for e in ("low", "medium", "high", "max", "xhigh")] == [
        BOS + tail, BOS + tail, BOS + REASONING_EFFORT_MAX_TEXT + tail, BOS + REASONING_EFFORT_MAX_0731_TEXT + tail,
        BOS + REASONING_EFFORT_MAX_0731_TEXT + tail]
    assert REASONING_EFFORT_MAX_0731_TEXT.startswith("Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless")
    assert REASONING_EFFORT_MAX_0731_TEXT.endswith("no error remains undiscovered.\n\n")
    assert encode_messages(msgs, thinking=True, reasoning_effort="none", effort_profile="0731") == \
        BOS + "<｜User｜>Q<｜Assistant｜></think>"


def test_effort_profile_is_read_off_the_shipped_encoder(tmp_path):
    assert detect_effort_profile(str(tmp_path))[0] == "preview"
    (tmp_path / "encoding").mkdir()
    enc = tmp_path / "encoding" / "encoding_dsv4.py"
    enc.write_text('REASONING_EFFORT_MAX = ("Reasoning Effort: Absolute maximum ...")\n')
    assert detect_effort_profile(str(tmp_path))[0] == "preview"
    enc.write_text('REASONING_EFFORT_PROMPTS = {"low": "", "high": "...", "max": "..."}\n'
                   'DEFAULT_REASONING_EFFORT = "low"\n')
    assert detect_effort_profile(str(tmp_path)) == ("0731", "encoding/encoding_dsv4.py defines REASONING_EFFORT_PROMPTS")
    assert detect_effort_profile(None)[0] == "preview"


def test_validate_runs_on_a_dspark_checkpoint(ckpt, tmp_path, capsys):
    """`dsv4 validate` checks the main model of a DSpark checkpoint unchanged (the draft is not read)."""
    import argparse

    from dsv4.tools import validate
    p = argparse.ArgumentParser()
    validate.add_parser(p.add_subparsers())
    args = p.parse_args(["validate", ckpt[("dspark", "official")], "--no-engine", "--prompt-len", "40",
                         "--steps", "1", "-q"])
    assert validate.run(args) == 0
    assert "RESULT: OK" in capsys.readouterr().out
