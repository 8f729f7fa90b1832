//! Pieces the bench binaries share.

use bytes::Bytes;

/// A streamed chat answer as vLLM frames it: one server-sent event a
/// frame (the role, then `tokens` events of one token each), the usage
/// chunk when `usage` (the request asked with
/// `stream_options.include_usage`), then `data: [DONE]`.
pub fn chat_stream_frames(tokens: usize, usage: bool) -> Vec<Bytes> {
    let mut out = Vec::with_capacity(tokens + 3);
    let head = r#"{"id":"chatcmpl-5b1e0f7c2a4d4e0c9f3e","object":"chat.completion.chunk","created":1765100000,"model":"tiny","choices":[{"index":0,"delta":"#;
    out.push(Bytes::from(format!(
        "data: {head}{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    )));
    for i in 0..tokens {
        out.push(Bytes::from(format!(
            "data: {head}{{\"content\":\" word{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        )));
    }
    if usage {
        out.push(Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-5b1e0f7c2a4d4e0c9f3e\",\"object\":\"chat.completion.chunk\",\"created\":1765100000,\"model\":\"tiny\",\"choices\":[],\"usage\":{{\"prompt_tokens\":812,\"total_tokens\":{},\"completion_tokens\":{tokens},\"prompt_tokens_details\":{{\"cached_tokens\":768}}}}}}\n\n",
            812 + tokens
        )));
    }
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

/// Whether `haystack` holds `needle` (small bodies: a plain scan).
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}
