//! Renders the Qwen3 chat template over a 50-turn tool-using conversation.
//! `benches/template_render.py` renders the same conversation from Python and
//! against transformers' jinja2 environment.
//!
//! Two more rows price templates that change lists in place (#34): Qwen3 with a
//! mutation prepended (the same render on mutable lists and dicts; the cost of
//! the representation alone) and Kimi K2 Instruct, whose tool-call id queue
//! appends and pops.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use compat_core::template::ChatTemplate;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::{json, Value};

const TEMPLATE: &str = "Qwen-Qwen3-0.6B.jinja";
const KIMI_TEMPLATE: &str = "moonshotai-Kimi-K2-Instruct.jinja";
const TURNS: usize = 50;
/// A no-op mutation: the rest of the template then renders on mutable values.
const MUTATION: &str = "{%- set _ = [].append(1) -%}";

fn template_path(name: &str) -> PathBuf {
    let shared = std::env::var_os("COMPAT_SHARED_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
        PathBuf::from,
    );
    shared.join("templates").join(name)
}

/// Each turn: user asks, assistant calls a tool, the tool answers, assistant replies.
fn conversation() -> Value {
    let tools = json!([{
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Path relative to the root"},
                    "max_lines": {"type": "integer", "minimum": 1, "default": 200}
                },
                "required": ["path"]
            }
        }
    }]);
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent."})];
    for turn in 0..TURNS {
        messages.push(json!({"role": "user", "content": format!("Step {turn}: open src/mod_{turn}.rs and summarise it.")}));
        messages.push(json!({
            "role": "assistant",
            "content": "",
            "tool_calls": [{
                "id": format!("call_{turn}"),
                "type": "function",
                "function": {"name": "read_file", "arguments": {"path": format!("src/mod_{turn}.rs"), "max_lines": 80}}
            }]
        }));
        messages.push(json!({
            "role": "tool",
            "tool_call_id": format!("call_{turn}"),
            "content": format!("pub fn f{turn}() -> u32 {{\n    {turn}\n}}\n")
        }));
        messages.push(json!({"role": "assistant", "content": format!("mod_{turn}.rs defines f{turn}, returning {turn}.")}));
    }
    json!({
        "messages": messages,
        "tools": tools,
        "documents": null,
        "add_generation_prompt": true,
        "eos_token": "<|im_end|>",
        "enable_thinking": false
    })
}

/// Renders for about a second and prints renders/s (criterion's numbers follow).
fn print_rate(label: &str, template: &ChatTemplate, ctx: &Value) {
    let prompt = template.render(ctx).expect("template renders");
    let start = Instant::now();
    let mut renders = 0u32;
    while start.elapsed() < Duration::from_secs(1) {
        std::hint::black_box(template.render(ctx).expect("renders"));
        renders += 1;
    }
    let per_sec = f64::from(renders) / start.elapsed().as_secs_f64();
    println!(
        "template_render: {label}, {TURNS} turns, {} chars: {per_sec:.0} renders/s ({:.1} us/render)",
        prompt.len(),
        1e6 / per_sec
    );
}

fn bench(c: &mut Criterion) {
    let (Ok(source), Ok(kimi_source)) = (
        std::fs::read_to_string(template_path(TEMPLATE)),
        std::fs::read_to_string(template_path(KIMI_TEMPLATE)),
    ) else {
        eprintln!(
            "template_render: {} not found; set COMPAT_SHARED_DIR",
            template_path(TEMPLATE).display()
        );
        return;
    };
    let template = ChatTemplate::new(&source).expect("template compiles");
    let mutable = ChatTemplate::new(&format!("{MUTATION}{source}")).expect("compiles");
    let kimi = ChatTemplate::new(&kimi_source).expect("template compiles");
    let ctx = conversation();
    assert_eq!(
        template.render(&ctx).expect("renders"),
        mutable.render(&ctx).expect("renders"),
        "a mutable context renders the same prompt"
    );

    print_rate(TEMPLATE, &template, &ctx);
    print_rate(&format!("{TEMPLATE} (mutable)"), &mutable, &ctx);
    print_rate(KIMI_TEMPLATE, &kimi, &ctx);

    let mut group = c.benchmark_group("template_render");
    group.throughput(Throughput::Elements(1));
    for (name, tpl) in [
        ("qwen3_50_turn_tools", &template),
        ("qwen3_50_turn_tools_mutable", &mutable),
        ("kimi_k2_instruct_50_turn_tools", &kimi),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| tpl.render(std::hint::black_box(&ctx)).expect("renders"));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
