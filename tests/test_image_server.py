"""Images through the real server (tiny V4.1 vision checkpoint), driven by the official openai / anthropic
clients: prompt usage counts the image span, a repeated image hits the prefix cache and reproduces the
tokens, and bad images are 400s that name the part and leave nothing allocated."""

from __future__ import annotations

import base64
import io

import anthropic
import deepseek_recipe as recipe
import openai
import pytest
from PIL import Image
from server_harness import running_server

from dsinfer.chat.format import IMAGE_PLACEHOLDER
from dsinfer.chat.image_reader import ImageLimits
from dsinfer.config import EngineConfig
from dsinfer.images.plan import plan_image
from dsinfer.tokenizer import Tokenizer


def png(width: int, height: int, color=(200, 30, 60)) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    for x in range(0, width, 7):
        image.putpixel((x, x % height), (0, 255, 0))
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def server(tiny_v41_vision_checkpoint):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=1024, block_tokens=8)  # chunked
    limits = ImageLimits(max_images=2, max_image_bytes=200_000, max_image_pixels=250 * 250)
    with running_server(tiny_v41_vision_checkpoint, config, image_limits=limits) as (base, engine):
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def text_prompt_tokens(checkpoint, messages) -> int:
    """Prompt tokens of the same chat with one placeholder per image, as deepseek-recipe encodes it."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    body = {"model": "DeepSeek-V4.1-Flash", "messages": messages, "thinking": {"type": "disabled"}}
    special = recipe.SpecialTokens(image=IMAGE_PLACEHOLDER)
    options = recipe.ConversionOptions().with_special_tokens(special)
    conversation = recipe.ChatCompletionRequest(body).convert(options).conversation
    encoding = recipe.DeepseekV41Encoding().with_special_tokens(special)
    return len(encoding.with_tokenizer(recipe.Tokenizer.from_str(tokenizer.to_json())).encode(conversation))


def test_image_chat_counts_the_span_and_hits_the_prefix_cache_the_second_time(
    server, client, tiny_v41_vision_checkpoint
):
    engine = server[1].engine
    messages = image_message(data_url(png(100, 70)))
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0,
              "extra_body": {"thinking": {"type": "disabled"}}}  # fmt: skip
    encoded_before = engine.runner.image_embeddings.images_encoded
    first = client.chat.completions.create(**kwargs)
    plan = plan_image(100, 70, engine.model.config.vision)
    expected = text_prompt_tokens(tiny_v41_vision_checkpoint, messages) - 1 + plan.num_tokens
    assert first.usage.prompt_tokens == expected
    assert engine.runner.image_embeddings.images_encoded == encoded_before + 1  # encoded once across chunks
    hits_before = engine.blocks.prefix_hits
    second = client.chat.completions.create(**kwargs)
    assert second.choices[0].message.content == first.choices[0].message.content
    hits_same = engine.blocks.prefix_hits - hits_before
    block = engine.blocks.block_tokens
    assert hits_same >= (expected - 1) // block - 1  # the whole prompt but the last block came from the cache
    # Another picture of the same size: only the blocks before its span may match.
    other = dict(kwargs, messages=image_message(data_url(png(100, 70, (10, 10, 250)))))
    hits_before = engine.blocks.prefix_hits
    client.chat.completions.create(**other)
    assert engine.blocks.prefix_hits - hits_before < hits_same


def test_streamed_image_chat_reports_the_same_usage(client):
    messages = image_message(data_url(png(90, 90)))
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert usage and usage[-1].prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "cannot be decoded"),
        ("data:image/png;base64,", "empty"),
        (data_url(png(300, 300)), "pixels"),
        ("https://example.com/cat.png", "remote image URLs"),
    ],
)
def test_bad_images_are_400s_naming_the_part(server, client, url, needle):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=image_message(url), max_tokens=2)
    message = str(caught.value)
    assert needle in message and "messages" in message
    engine = server[1].engine
    assert not engine.requests and engine.blocks.num_used == 0  # nothing reached the engine


def test_too_many_images_is_a_400_and_the_server_keeps_serving(client):
    url = data_url(png(40, 40))
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        client.chat.completions.create(model="tiny", messages=image_message(url, url, url), max_tokens=2)
    ok = client.chat.completions.create(
        model="tiny", messages=image_message(url, url), max_tokens=2, extra_body={"ignore_eos": True}
    )  # a sampled end token is no failure
    assert ok.usage.completion_tokens == 2


def test_responses_input_image_and_messages_image_block(server, client):
    url = data_url(png(80, 60))
    response = client.responses.create(model="tiny", max_output_tokens=3, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe."}, {"type": "input_image", "image_url": url}]}])  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=image_message(url, text="Describe."), max_tokens=3)
    assert response.usage.input_tokens > 20 and chat.usage.prompt_tokens > 20
    claude = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0, timeout=300)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(80, 60)).decode()}
    message = claude.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "Describe."}]}])  # fmt: skip
    text_only = claude.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Describe."}])
    plan = plan_image(80, 60, server[1].engine.model.config.vision)
    assert message.usage.input_tokens >= text_only.usage.input_tokens + plan.num_tokens - 1
