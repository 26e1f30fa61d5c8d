"""A cluster configured with ``router.api_keys_file`` and TLS: both front doors (gRPC
through the SDK, HTTPS through the OpenAI client) serve a request with the key
and refuse one without it before any worker sees it; a key rotated in the file
takes effect while the cluster runs. Real Ray actors, the tiny model."""

from __future__ import annotations

import ssl

import openai
import pytest

from splitserve.client import Client, Unauthenticated
from tests.integration.cluster_util import live_cluster, mixed_workload, tiny_config
from tests.unit.router.test_server import self_signed
from tests.waiting import wait_until

KEY, ROTATED = "sk-cluster-1b2c", "sk-cluster-rotated-9d"


@pytest.fixture(scope="module")
def secured(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    keys = tmp / "keys"
    keys.write_text(f"{KEY}\n")
    key, cert = self_signed(tmp)
    router = {
        "port": 0,
        "http_port": 0,
        "shutdown_grace_s": 1,
        "api_keys_file": str(keys),
        "tls_cert": str(cert),
        "tls_key": str(key),
    }
    with live_cluster(tiny_config(checkpoint, router=router)) as c:
        yield c, keys, cert


def test_both_doors_need_the_key_and_rotation_needs_no_restart(secured, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    cluster, keys, cert = secured
    ca = cert.read_bytes()
    prompt = mixed_workload(1, seed=3)[0][0]

    def client(key: str | None) -> Client:
        return Client(cluster.address, root_certificates=ca, retries=0, timeout=120, api_key=key)

    with client(None) as anonymous:
        assert anonymous.health()
        with pytest.raises(Unauthenticated, match="requires an API key"):
            anonymous.generate(prompt, temperature=0, max_tokens=4)
    assert cluster.dispatcher.admitted == 0  # refused at the door: no worker saw it
    with client(KEY) as c:
        out = c.generate(prompt, temperature=0, max_tokens=6, ignore_eos=True)
    assert len(out.token_ids) == 6

    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert)))
    base, model = f"https://{cluster.http_address}/v1", cluster.dispatcher.served_model

    def complete(key: str):
        api = openai.OpenAI(base_url=base, api_key=key, max_retries=0, http_client=http)
        return api.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )

    with pytest.raises(openai.AuthenticationError):
        complete(ROTATED)
    assert cluster.dispatcher.admitted == 1
    assert complete(KEY).usage.completion_tokens == 6
    assert cluster.dispatcher.admitted == 2

    keys.write_text(f"{ROTATED}\n")  # the cluster watches the file

    def rotated_key_works() -> bool:
        with client(ROTATED) as c:
            try:
                c.list_models()
            except Unauthenticated:
                return False
        return True

    wait_until(rotated_key_works, "the rotated key taken up", 60, 0.1)
    with client(KEY) as old, pytest.raises(Unauthenticated, match="not valid"):
        old.list_models()
