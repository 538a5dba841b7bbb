"""``EcpLmTokenizer``: an ecp-lm tokenizer as a transformers fast tokenizer.

It gives exactly ecp-lm's ids and adds no special tokens, as ``PreTrainedTokenizerFast`` does
over the same ``tokenizers`` core. What it adds is ``document_start_id``: the id of the token
that is exactly a line end, the token before a document in the streams ecp-lm trains on. It is
reported as ``bos_token_id`` (and as ``pad_token_id``) without being made a special token, so
that a harness that scores a document's first token after the BOS token, as
lm-evaluation-harness does, conditions it on a line end, while encoding and decoding stay
ecp-lm's (a special token would be cut out of any text that spells it, and dropped by
``decode(skip_special_tokens=True)``). ``None`` where the vocabulary has no such token (a
WordPiece vocabulary that drops whitespace); the BOS id is then unset, as before.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from ecp_lm.data.tokenizers import Tokenizer


def line_end_id(tokenizer: Tokenizer) -> int | None:
    """The id of the one token that encodes and decodes as exactly "\\n", or None."""
    ids = tokenizer.encode("\n").tolist()
    return ids[0] if len(ids) == 1 and tokenizer.decode(ids) == "\n" else None


class EcpLmTokenizer(PreTrainedTokenizerFast):
    """A fast tokenizer whose BOS and padding ids are ``document_start_id`` (see the module)."""

    # No __init__ of its own: transformers then reads tokenizer.json as it is, as for
    # PreTrainedTokenizerFast. ``document_start_id`` is an init keyword that it keeps in
    # ``init_kwargs`` and saves in tokenizer_config.json.

    @classmethod
    def from_ecp_lm(cls, tokenizer: Tokenizer) -> EcpLmTokenizer:
        return cls(tokenizer_object=tokenizer.core(), clean_up_tokenization_spaces=False,
                   document_start_id=line_end_id(tokenizer))

    def _stand_in(self, name: str) -> int | None:
        token = self.__dict__.get("_special_tokens_map", {}).get(name)
        if token is not None:
            return self.convert_tokens_to_ids(str(token))
        return self.document_start_id

    @property
    def document_start_id(self) -> int | None:
        return self.__dict__.get("init_kwargs", {}).get("document_start_id")

    @property
    def bos_token_id(self) -> int | None:
        return self._stand_in("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._stand_in("pad_token")
