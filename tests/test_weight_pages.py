"""The pages of float32 weights that a kernel's own copy replaced are handed back (enginecore/weight_pages.py):
the engine of the default group holds a fraction of the model's file, and a weight whose pages were dropped
reads back the same bytes from the file."""
import openai
import psutil
import torch
from enginecore import weight_pages

from tests.supervise_process import title_of
from tests.test_engine_support import loaded_model


def test_a_released_weight_reads_back_the_same_bytes_and_memory_of_its_own_is_left_alone():
    layer = loaded_model().model.model.layers[0]
    weight = layer.mlp.down_proj.weight  # a view of the model's safetensors file
    before = weight.clone()
    assert weight_pages.release([weight]) > 0.9 * weight.numel() * weight.element_size()
    assert torch.equal(weight, before)
    own = torch.randn(512, 1024)  # the process's own memory: dropping its pages would zero it
    copy = own.clone()
    assert weight_pages.release([own]) == 0 and torch.equal(own, copy)


def test_the_default_engine_keeps_little_of_the_models_file_and_answers_right(served):
    """513 MB of the file stayed resident after the products were packed (40% of the engine's RSS); now about
    the embedding's 113 MB, which the lean forward looks rows up in."""
    engine = next(p for p in psutil.Process(served.pid).children(recursive=True) if "EngineCore" in title_of(p))
    resident = sum(m.rss for m in engine.memory_maps() if m.path.endswith("model.safetensors"))
    assert 0 < resident < 200 * 2**20, resident
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content
