//! `shoal sql`: one statement (`-e`), statements from a pipe, or an interactive shell with
//! history and multi-line input (a statement ends with `;`).

use std::io::{IsTerminal, Read};

use serde_json::{json, Value};
use shoal_client::Client;

use crate::cli::{print_table, CliError};
use crate::Output;

/// Where the shell keeps its history, under the home directory.
const HISTORY_FILE: &str = ".shoal_sql_history";

#[derive(clap::Args)]
pub struct SqlArgs {
    /// Run this statement and exit.
    #[arg(short = 'e', long = "execute")]
    execute: Option<String>,
    /// Parameters `$1`, `$2`, ... as one JSON array, e.g. '[30, "Oslo"]'.
    #[arg(long)]
    params: Option<String>,
    /// Wait until indexes hold every change made before the statement.
    #[arg(long)]
    request_plus: bool,
    /// Run on the analytics path (`/v1/analytics`, the columnar shadows).
    #[arg(long)]
    analytics: bool,
}

pub async fn run(url: &str, output: Output, args: SqlArgs) -> Result<(), CliError> {
    let client = Client::new(url)?;
    let params: Value = match &args.params {
        Some(p) => serde_json::from_str(p).map_err(|e| CliError::Usage(format!("--params: not a JSON array ({e})")))?,
        None => json!([]),
    };
    if !params.is_array() {
        return Err(CliError::Usage("--params takes a JSON array".into()));
    }
    let consistency = if args.request_plus { "request_plus" } else { "not_bounded" };
    let analytics = args.analytics;
    let one = |sql: String| {
        let (client, params) = (&client, params.clone());
        async move {
            let request = json!({"sql": sql, "params": params, "consistency": consistency});
            let answer = if analytics { client.analytics(&request).await? } else { client.query(&request).await? };
            print_answer(output, &answer);
            Ok::<_, CliError>(())
        }
    };
    if let Some(sql) = args.execute {
        return one(sql).await;
    }
    if !std::io::stdin().is_terminal() {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        for statement in statements(&text) {
            one(statement).await?;
        }
        return Ok(());
    }
    shell(one).await
}

/// Splits text into statements at `;` outside quotes.
fn statements(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match (quote, c) {
            (None, ';') => {
                if !current.trim().is_empty() {
                    out.push(current.trim().to_string());
                }
                current.clear();
                continue;
            }
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_string());
    }
    out
}

async fn shell<F, Fut>(one: F) -> Result<(), CliError>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<(), CliError>>,
{
    let mut editor = rustyline::DefaultEditor::new().map_err(|e| CliError::Usage(format!("terminal: {e}")))?;
    let history = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(HISTORY_FILE));
    if let Some(h) = &history {
        let _ = editor.load_history(h);
    }
    println!("shoal sql — end a statement with ';', quit with \\q or Ctrl-D");
    let mut pending = String::new();
    loop {
        let prompt = if pending.is_empty() { "shoal> " } else { "   ...> " };
        let line = match editor.readline(prompt) {
            Ok(line) => line,
            Err(rustyline::error::ReadlineError::Interrupted) => {
                pending.clear();
                continue;
            }
            Err(_) => break,
        };
        if pending.is_empty() && matches!(line.trim(), "\\q" | "exit" | "quit") {
            break;
        }
        pending.push_str(&line);
        pending.push('\n');
        if !line.trim_end().ends_with(';') {
            continue;
        }
        let _ = editor.add_history_entry(pending.trim());
        for statement in statements(&pending) {
            if let Err(e) = one(statement).await {
                eprintln!("{e}");
            }
        }
        pending.clear();
    }
    if let Some(h) = &history {
        let _ = editor.save_history(h);
    }
    Ok(())
}

fn print_answer(output: Output, answer: &Value) {
    let columns: Vec<&str> = answer["columns"].as_array().map(|c| c.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let rows: &[Value] = answer["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    match output {
        Output::Json => println!("{answer}"),
        Output::Csv => {
            println!("{}", columns.iter().map(|c| csv_cell(c)).collect::<Vec<_>>().join(","));
            for row in rows {
                let cells: Vec<String> = row.as_array().map(|r| r.iter().map(|v| csv_cell(&text(v))).collect()).unwrap_or_default();
                println!("{}", cells.join(","));
            }
        }
        Output::Table => {
            let cells: Vec<Vec<String>> =
                rows.iter().map(|r| r.as_array().map(|r| r.iter().map(text).collect()).unwrap_or_default()).collect();
            print_table(&columns, cells);
            let ms = answer["metrics"]["elapsed_ms"].as_f64().unwrap_or(0.0);
            println!("({} rows, {ms:.1} ms)", rows.len());
        }
    }
}

/// A value as a cell: strings as they are, NULL for null, JSON for the rest.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "NULL".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// RFC 4180 quoting.
fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_at_semicolons_outside_quotes() {
        assert_eq!(
            statements("SELECT 1; SELECT ';' AS x;\n SELECT \"a;b\" FROM t"),
            ["SELECT 1", "SELECT ';' AS x", "SELECT \"a;b\" FROM t"]
        );
        assert!(statements(" ; ;").is_empty());
    }

    #[test]
    fn csv_cells_are_quoted_when_needed() {
        assert_eq!(csv_cell("plain"), "plain");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
