//! LangChain through the gateway, as its users wire it to any
//! OpenAI-compatible server: `ChatOpenAI` (invoke and stream) and
//! `OpenAIEmbeddings` with `check_embedding_ctx_length=False` (its token
//! counting would fetch files from the internet), both pointed at the
//! gateway's `/v1` and routed by model name or alias.

mod common;

use common::Gateway;

/// Whether `langchain_openai` is installed; under CI it must be
/// (`.ci/run` installs it), elsewhere the test skips.
fn has_langchain() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "import langchain_openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "langchain-openai is required under CI"
        );
        eprintln!("SKIPPED: pip install langchain-openai");
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn langchain_chat_and_embeddings_work_through_the_gateway() {
    if !has_langchain() {
        return;
    }
    let gw = Gateway::start(
        r#"
        [[apps]]
        name = "chat"
        aliases = ["org/chat-model"]
        command = ["{worker}"]
        [[apps]]
        name = "embed"
        command = ["{worker}"]
        "#,
    );
    let script = r#"
import sys
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
base = sys.argv[1] + "/v1"
llm = ChatOpenAI(base_url=base, api_key="unused", model="org/chat-model", max_retries=0)
answer = llm.invoke("hello")
assert answer.content, answer
chunks = [c.content for c in llm.stream("hello")]
assert len(chunks) >= 2 and "".join(chunks), chunks
emb = OpenAIEmbeddings(base_url=base, api_key="unused", model="embed",
                       check_embedding_ctx_length=False, max_retries=0)
vectors = emb.embed_documents(["one", "two", "three"])
assert len(vectors) == 3 and all(len(v) == len(vectors[0]) > 0 for v in vectors), vectors
one = emb.embed_query("one")
assert one == vectors[0], "the same text embeds the same"
print("LANGCHAIN ok", len(chunks), len(vectors[0]))
"#;
    let url = gw.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-c", script, &url])
            .output()
            .expect("run python3")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "LangChain failed through the gateway:\n{stdout}\n{stderr}\n{}",
        gw.log()
    );
    assert!(stdout.contains("LANGCHAIN ok"), "{stdout}");
}
