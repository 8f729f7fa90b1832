//! The official `openai` Python client against the gateway: models list
//! and retrieve (ids with a slash too), chat (plain and streamed) and
//! completions, and each error class as the client sees it (`status_code`,
//! `code`, `type`, `param`), with no retry where a retry cannot help.

mod common;

use common::Gateway;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_lists_retrieves_chats_and_reads_errors() {
    if !common::has_openai() {
        return;
    }
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "m"
        aliases = ["org/model-x"]
        command = ["{worker}"]
        [[apps]]
        name = "stuck"
        command = ["sleep", "600"]
        [apps.queue]
        timeout = "1s"
        [[apps]]
        name = "busy"
        command = ["{worker}"]
        concurrency = 1
        [apps.autoscale]
        min = 1
        max = 1
        [apps.queue]
        timeout = "1s"
        "#,
    );
    gw.wait_ready("busy", 1).await;
    let script = r#"
import sys, openai
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=2)
ids = sorted(m.id for m in client.models.list())
assert ids == ["busy", "m", "org/model-x", "stuck"], ids
assert client.models.retrieve("m").id == "m"
assert client.models.retrieve("org/model-x").id == "org/model-x"
chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
assert chat.choices[0].message.content, chat
streamed = list(client.chat.completions.create(
    model="org/model-x", messages=[{"role": "user", "content": "hi"}], stream=True))
assert len(streamed) >= 2, streamed
# The test worker answers every completion route alike; the gateway routed
# it by "model".
text = client.completions.create(model="m", prompt="hi")
assert text.model == "m" and text.choices, text

def expect(call, cls, status, code, param=None):
    try:
        call()
    except cls as e:
        assert e.status_code == status, (e.status_code, e.body)
        assert e.code == code, e.body
        assert e.type in ("invalid_request_error", "authentication_error",
                          "rate_limit_error", "server_error"), e.body
        assert e.param == param, e.body
        assert e.response.headers.get("x-should-retry") == "false", dict(e.response.headers)
        print("ok", code, e.type)
        return
    raise AssertionError("no error")

expect(lambda: client.models.retrieve("nope"), openai.NotFoundError, 404, "not_found", "model")
expect(lambda: client.chat.completions.create(model="nope", messages=[]),
       openai.NotFoundError, 404, "not_found", "model")
expect(lambda: client.post("/chat/completions", body={"messages": []}, cast_to=object),
       openai.BadRequestError, 400, "bad_request")
# A request that waits out the queue timeout behind a busy replica is not
# sent again.
import json, os, threading, time, urllib.request
hold = threading.Thread(target=lambda: client.chat.completions.create(
    model="busy", messages=[], extra_headers={"x-test-latency-ms": "5000"}))
hold.start()
for _ in range(200):
    status = json.load(urllib.request.urlopen(urllib.request.Request(
        sys.argv[1] + "/v1/status",
        headers={"Authorization": "Bearer " + os.environ["WARMGATE_ADMIN_TOKEN"]})))
    if [a["inflight"] for a in status["apps"] if a["name"] == "busy"] == [1]:
        break
    time.sleep(0.05)
expect(lambda: client.chat.completions.create(model="busy", messages=[]),
       openai.InternalServerError, 504, "timeout")
hold.join()
# One that waits it out while the app is still starting may come back.
try:
    client.with_options(max_retries=0).chat.completions.create(model="stuck", messages=[])
    raise AssertionError("no error")
except openai.InternalServerError as e:
    assert e.status_code == 503 and e.code == "starting", e.body
    assert e.response.headers.get("x-should-retry") != "false", dict(e.response.headers)
    assert int(e.response.headers.get("retry-after")) >= 1, dict(e.response.headers)
    print("ok starting")
"#;
    let token = gw.admin_token();
    let text = common::python_with(script, &gw.url, &[("WARMGATE_ADMIN_TOKEN", &token)]).await;
    assert_eq!(text.matches("ok ").count(), 5, "{text}");
    // One timeout, not three: the client obeyed x-should-retry.
    let timeouts = gw
        .metric(r#"warmgate_requests_total{app="busy",outcome="timeout"}"#)
        .await;
    assert_eq!(timeouts, 1.0);
}

/// The error classes the first test does not reach, as the official client
/// raises them: a wrong key (401), a body over the limit (413), a replica
/// that dies mid-request (502) and a tenant over its rate (429 with
/// `Retry-After`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_reads_auth_size_replica_and_quota_errors() {
    if !common::has_openai() {
        return;
    }
    let gw = Gateway::start_with(
        r#"
        [limits]
        max_body_bytes = 4096
        [[tenants]]
        name = "team"
        api_key_env = "WG_OPENAI_TEST_KEY"
        rps = 0.2
        burst = 3
        [[apps]]
        name = "m"
        command = ["{worker}"]
        "#,
        &[],
        &[("WG_OPENAI_TEST_KEY", "team-key-0123456789")],
    );
    let script = r#"
import sys, openai
from openai import OpenAI
base = sys.argv[1] + "/v1"
client = OpenAI(base_url=base, api_key="team-key-0123456789", max_retries=0)
hi = [{"role": "user", "content": "hi"}]

def expect(call, cls, status, code, typ, no_retry):
    try:
        call()
    except cls as e:
        assert e.status_code == status, (e.status_code, e.body)
        assert e.code == code, e.body
        assert e.type == typ, e.body
        retry = e.response.headers.get("x-should-retry")
        assert (retry == "false") == no_retry, dict(e.response.headers)
        print("ok", code, e.type)
        return e
    raise AssertionError("no error for " + code)

wrong = OpenAI(base_url=base, api_key="not-the-key", max_retries=0)
expect(lambda: wrong.chat.completions.create(model="m", messages=hi),
       openai.AuthenticationError, 401, "unauthorized", "authentication_error", True)
expect(lambda: client.chat.completions.create(
           model="m", messages=[{"role": "user", "content": "x" * 10000}]),
       openai.APIStatusError, 413, "too_large", "invalid_request_error", True)
expect(lambda: client.chat.completions.create(
           model="m", messages=hi, extra_headers={"x-test-crash": "1"}),
       openai.InternalServerError, 502, "replica_failed", "server_error", False)
for _ in range(20):
    try:
        client.chat.completions.create(model="m", messages=hi)
    except openai.RateLimitError:
        break
e = expect(lambda: client.chat.completions.create(model="m", messages=hi),
           openai.RateLimitError, 429, "quota_exceeded", "rate_limit_error", False)
assert int(e.response.headers["retry-after"]) >= 1, dict(e.response.headers)
"#;
    let text = common::python(script, &gw.url).await;
    assert_eq!(text.matches("ok ").count(), 4, "{text}");
}

/// An app in a crash loop, as the official client sees it: one request,
/// not three (it obeys `x-should-retry: false`), raising the 502 with the
/// state and the worker's last words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_does_not_retry_a_crash_loop() {
    if !common::has_openai() {
        return;
    }
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "looping"
        command = ["{worker}"]
        env = { TEST_WORKER_EXIT_AT_START = "3" }
        "#,
    );
    gw.wait_crash_loop("looping").await;
    let script = r#"
import sys, httpx, openai
from openai import OpenAI
sent = []
http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url)]})
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=2, http_client=http)
try:
    client.chat.completions.create(model="looping", messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("no error")
except openai.InternalServerError as e:
    assert e.status_code == 502 and e.code == "replica_failed", e.body
    assert e.response.headers.get("x-should-retry") == "false", dict(e.response.headers)
    assert "CrashLoopBackOff" in e.message and "exited with status 3" in e.message, e.message
assert len(sent) == 1, sent
print("ok crash loop")
"#;
    let text = common::python_with(script, &gw.url, &[]).await;
    assert!(text.contains("ok crash loop"), "{text}");
}
