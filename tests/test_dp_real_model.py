"""End to end with the real engine: the embedded model on the CPU in two ranks, rank 0 on the head and rank 1 on
a headless node over TCP with the deployment's key, and the `openai` client against the head. Each rank answers
the same greedy question with the same tokens: the remote rank is the same model, reached the same way."""
import openai

from tests.dp_support import deployment, free_port, key_file  # noqa: F401

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # two engines on a 2-core machine: one core each


def test_the_embedded_model_in_two_ranks_answers_through_the_head(deployment, key_file):
    rpc = free_port()
    common = ["--data-parallel-size", "2", "--data-parallel-rpc-port", str(rpc), "--data-parallel-key-file", key_file]
    head = deployment.head(*common, "--data-parallel-size-local", "1", wait=False, env=ONE_THREAD)
    deployment.node(*common, "--data-parallel-start-rank", "1", env=ONE_THREAD)
    head.wait_serving()
    client = openai.OpenAI(base_url=head.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    answers = {}
    for rank in (0, 1):
        reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12,
                                               extra_headers={"X-data-parallel-rank": str(rank)})
        answers[rank] = reply.choices[0].message.content
    assert "Paris" in answers[0] and answers[0] == answers[1], answers

    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12,
                                            stream=True, extra_headers={"X-data-parallel-rank": "1"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answers[1]
    plain = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=3)
    assert "Paris" in plain.choices[0].text
