"""Small random encoder checkpoints in Hugging Face layout, written by transformers itself:
BERT (a WordPiece tokenizer) and XLM-RoBERTa (a Unigram tokenizer), each as the bare model
(with sentence-transformers' modules.json and 1_Pooling, as embedding models ship) or as a
sequence classifier (a cross-encoder)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import write_sentence_transformers_files

WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or "
    "query document search rank score answer question model text token cat dog paris "
    "france capital city river blue green fast slow small large who what when where why "
    "how one two three four five bert roberta encoder embedding pair hello world"
).split()
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'-"
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)


def _bert_tokenizer():
    import transformers as hf

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *LETTERS]
    vocab += [f"##{c}" for c in LETTERS] + ["##s", "##ing", "##ed"]
    vocab = list(dict.fromkeys(vocab))
    tokenizer = hf.BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)})
    return tokenizer, len(vocab)


def _xlmr_tokenizer():
    import transformers as hf
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    pieces = [(s, 0.0) for s in specials]
    pieces += [("▁" + w, -2.0 - i * 0.01) for i, w in enumerate(WORDS)]
    pieces += [(c, -8.0) for c in LETTERS] + [("▁", -6.0)]
    pieces += [("▁" + c, -7.0) for c in LETTERS[:26]]
    backend = Tokenizer(models.Unigram(pieces, unk_id=3))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = hf.XLMRobertaTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<unk>",
    )
    return tokenizer, len(pieces)


def write_encoder_checkpoint(
    out_dir: Path, family: str, classifier: bool = False, num_labels: int = 1, seed: int = 0
) -> Path:
    """`family`: "bert" or "xlm-roberta". A classifier gets `num_labels` labels; a bare model
    gets modules.json and 1_Pooling/config.json (mean pooling, then Normalize)."""
    import torch
    import transformers as hf

    out_dir.mkdir(parents=True, exist_ok=True)
    if family == "bert":
        tokenizer, vocab = _bert_tokenizer()
        config = hf.BertConfig(vocab_size=vocab, **SHAPE)
        classes = (hf.BertModel, hf.BertForSequenceClassification)
    else:
        tokenizer, vocab = _xlmr_tokenizer()
        config = hf.XLMRobertaConfig(
            vocab_size=vocab,
            **dict(SHAPE, max_position_embeddings=SHAPE["max_position_embeddings"] + 2),
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        )
        classes = (hf.XLMRobertaModel, hf.XLMRobertaForSequenceClassification)
    if classifier:
        config.num_labels = num_labels
        config.id2label = {i: f"LABEL_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(seed)
    model = classes[1 if classifier else 0](config)
    with torch.no_grad():  # weights large enough that every layer matters
        for name, param in model.named_parameters():
            if "LayerNorm" not in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    tokenizer.model_max_length = 512
    tokenizer.save_pretrained(out_dir)
    if not classifier:
        pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
        write_sentence_transformers_files(out_dir, pooling)
    return out_dir
