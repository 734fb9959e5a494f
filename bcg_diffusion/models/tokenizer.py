"""A small Qwen-style tokenizer built in code, for random-weight pipelines that must work without the model hub.

It is not Qwen's BPE vocabulary: it is a WordPiece vocabulary over a built-in English word list plus single
characters (so any ASCII word still tokenizes, into pieces), with Qwen's chat special tokens. What the diffusers
pipelines rely on is kept:

* the Qwen-Image prompt template prefix tokenizes into exactly 34 tokens, as with the real tokenizer, because
  ``QwenImagePipeline`` drops the first 34 hidden states;
* a Qwen3-style chat template (``enable_thinking`` aware) for ``ZImagePipeline``;
* a pad token, right padding, and ids far below the real text encoders' vocabulary sizes;
* prompts with more words give more tokens.
"""

from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["build_offline_tokenizer"]

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
_SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
# Ordinary added tokens in Qwen3 (not special): only the chat template emits them, with enable_thinking=False.
_THINK_TOKENS = ("<think>", "</think>")

# Qwen3's template, reduced to plain text messages.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Words of the Qwen-Image template, the package's default prompts and common image-prompt vocabulary.
_WORDS = """
a about above across after against air all along also among an ancient and angle animal another antique any assistant
apple arch architecture are arm around arranged art artist as at atmosphere autumn away baby back background bag ball
balloon bank bark basket be beach beam bear bearings beautiful bed bedroom bees behind bell below bench beneath
beside between bicycle big bird black blanket blue blurred board boat boats body book books bottle bottom bowl
box boy brass bread breakfast bridge bright brown brush building buildings bustling but butterfly by cafe cake
calm camera candle canvas car card castle cat cathedral ceiling center chair chalk cherry child children
chrome church cinematic city classic clean clear clock close cloth clouds coast coat cobblestones coffee coiled
coins cold color colorful colors composition concrete cool corner counts country cozy creates crisp crowd
crystal cup curtain dark dawn day deep delicate depth describe desert desk detail detailed detailing details
dog door down dragon dramatic drift dress dry during dusk each early edge elderly evening every eye eyes fabric
face fall false family far field fine fire fish fishing flat floor flower flowers fog foggy food for forest
foreground form fox frame fresh from front fruit full garden gears gentle girl glass glow glowing gold golden
grass gray green grilled ground hair hairspring hand handmade handwritten hanging harbor hat head heavy her
high highly hill his holds horizon horse hot house ice illustration image in ink inner interior into is island
it its jeweled jungle kitchen label lake lamp landscape lanterns large late leaf leaves left lens library
light lighthouse lighting lights like line lines little long low magnifying man many map market mechanical
metal middle mirror mist modern moon morning mountain mountains moss narrow neat neon night nook
north notes objects ocean of oil old on one open opened orange orbit out outside over painting palace paper
park path pattern people person photo photograph photorealistic piano pink plant plate pocket portrait
pottery purple quantity quiet rain rainy reads reading red reflect reflection relationships rest rests
reveal river road rock rocks roof room rose round ruins sand says screws sea seen sell set shadow shadows shape sharp
shelf ship shop side sign silver simple size sizes sky sleeping small smoke snow soft space spatial spring
square stacks stairs stalls star stars steel stone stormy street strings studio style summer sun sunlight
sunset surface swan system table tall tea technical telescope text texture that the their them there they thin this through
tiny to top tower town toy train tree trees two umbrella under up upper user vase velvet very view
village vintage wall walls warm watch water wave waves wearing wet while white who wide wild window
windows winter wind with woman wood wooden workings world yellow young
"""


def _vocabulary() -> dict[str, int]:
    pieces = [*_SPECIAL_TOKENS, *_THINK_TOKENS, "\n", *string.punctuation]
    characters = string.digits + string.ascii_lowercase
    pieces += [*characters, *(f"##{c}" for c in characters)]
    pieces += sorted(set(_WORDS.split()) - set(pieces))
    return {piece: index for index, piece in enumerate(pieces)}


def build_offline_tokenizer() -> PreTrainedTokenizerFast:
    """Build the offline tokenizer (deterministic, no files, well under a second).

    Returns a fresh ``PreTrainedTokenizerFast`` with ``pad_token`` ``<|endoftext|>``, ``eos_token`` ``<|im_end|>``,
    ``unk_token`` ``<unk>`` (only for non-ASCII characters), right padding and a Qwen3-style ``chat_template``.
    Its ids are ``0 .. len(tokenizer) - 1``; ``len(tokenizer)`` is a few hundred.
    """
    backend = Tokenizer(models.WordPiece(_vocabulary(), unk_token=UNK_TOKEN, max_input_chars_per_word=100))
    backend.normalizer = normalizers.Lowercase()
    # Drop spaces and tabs; keep every word, punctuation character and newline as its own piece, so that the
    # Qwen-Image template prefix comes out at the real tokenizer's 34 tokens.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\w+|[^\w\s]|\n"), behavior="isolated"),
        ]
    )
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in _SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in _THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
