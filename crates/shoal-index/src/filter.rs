//! An index's `where`: a SQL boolean expression over the document, parsed with `sqlparser`
//! and compiled to a small tree that is evaluated per document.
//!
//! Supported: field references (`type`, `a.b`, `"quoted name"`), literals (numbers,
//! `'strings'`, `TRUE`, `FALSE`, `NULL`), `= != <> < <= > >=`, `AND OR NOT`, `IS [NOT]
//! NULL`, `[NOT] IN (...)`, `[NOT] BETWEEN .. AND ..`, `[NOT] LIKE` (`%` and `_`), unary
//! minus, parentheses. Anything else is refused when the index is defined.
//!
//! Logic is SQL's three-valued logic: a comparison with a missing field, or between values
//! of different JSON types, is unknown; a document is indexed only if the filter is true.

use std::borrow::Cow;
use std::cmp::Ordering;

use serde_json::Value;
use shoal_json::path::Segment;
use sqlparser::ast::{BinaryOperator, Expr, UnaryOperator, Value as SqlValue};
use sqlparser::dialect::GenericDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::Token;

use crate::keycode;

/// Longest `where` text, in bytes.
pub const FILTER_MAX_BYTES: usize = 4096;
/// Deepest expression nesting accepted (sqlparser has its own recursion limit too).
const FILTER_DEPTH_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("where: {0}")]
pub struct FilterError(pub String);

#[derive(Debug, Clone)]
pub enum Filter {
    Field(Vec<Segment>),
    Literal(Value),
    Cmp(Box<Filter>, Cmp, Box<Filter>),
    And(Box<Filter>, Box<Filter>),
    Or(Box<Filter>, Box<Filter>),
    Not(Box<Filter>),
    IsNull(Box<Filter>, bool),
    In(Box<Filter>, Vec<Filter>, bool),
    Like(Box<Filter>, Box<Filter>, bool),
    Neg(Box<Filter>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Filter {
    pub fn parse(text: &str) -> Result<Filter, FilterError> {
        if text.len() > FILTER_MAX_BYTES {
            return Err(FilterError(format!("longer than {FILTER_MAX_BYTES} bytes")));
        }
        let dialect = GenericDialect {};
        let mut parser =
            Parser::new(&dialect).with_recursion_limit(FILTER_DEPTH_MAX).try_with_sql(text).map_err(|e| FilterError(e.to_string()))?;
        let expr = parser.parse_expr().map_err(|e| FilterError(e.to_string()))?;
        let next = parser.peek_token();
        if next.token != Token::EOF {
            return Err(FilterError(format!("unexpected {} at {}", next.token, next.span.start)));
        }
        compile(&expr, 0)
    }

    /// Whether the document passes: only a definite `true` does.
    pub fn matches(&self, doc: &Value) -> bool {
        matches!(self.truth(doc), Some(true))
    }

    fn truth(&self, doc: &Value) -> Option<bool> {
        match self {
            Filter::And(a, b) => match (a.truth(doc), b.truth(doc)) {
                (Some(false), _) | (_, Some(false)) => Some(false),
                (Some(true), Some(true)) => Some(true),
                _ => None,
            },
            Filter::Or(a, b) => match (a.truth(doc), b.truth(doc)) {
                (Some(true), _) | (_, Some(true)) => Some(true),
                (Some(false), Some(false)) => Some(false),
                _ => None,
            },
            Filter::Not(a) => a.truth(doc).map(|t| !t),
            Filter::IsNull(a, negated) => {
                let is_null = matches!(a.value(doc).as_deref(), None | Some(Value::Null));
                Some(is_null != *negated)
            }
            Filter::Cmp(a, op, b) => compare(a.value(doc).as_deref(), *op, b.value(doc).as_deref()),
            Filter::In(a, list, negated) => {
                let v = a.value(doc)?;
                let mut unknown = false;
                for item in list {
                    match compare(Some(&v), Cmp::Eq, item.value(doc).as_deref()) {
                        Some(true) => return Some(!negated),
                        None => unknown = true,
                        Some(false) => {}
                    }
                }
                if unknown {
                    None
                } else {
                    Some(*negated)
                }
            }
            Filter::Like(a, pattern, negated) => match (a.value(doc).as_deref(), pattern.value(doc).as_deref()) {
                (Some(Value::String(s)), Some(Value::String(p))) => Some(like(s.as_bytes(), p.as_bytes()) != *negated),
                _ => None,
            },
            Filter::Field(_) | Filter::Literal(_) | Filter::Neg(_) => match self.value(doc).as_deref() {
                Some(Value::Bool(b)) => Some(*b),
                _ => None,
            },
        }
    }

    /// The value of an operand: borrowed from the document or the filter where possible.
    fn value<'a>(&'a self, doc: &'a Value) -> Option<Cow<'a, Value>> {
        match self {
            Filter::Field(path) => shoal_json::subdoc::navigate(doc, path).ok().map(Cow::Borrowed),
            Filter::Literal(v) => Some(Cow::Borrowed(v)),
            Filter::Neg(a) => match a.value(doc)?.as_ref() {
                Value::Number(n) => match n.as_i64() {
                    Some(i) => i.checked_neg().map(|i| Cow::Owned(Value::from(i))),
                    None => n.as_f64().and_then(|f| serde_json::Number::from_f64(-f)).map(|n| Cow::Owned(Value::Number(n))),
                },
                _ => None,
            },
            other => other.truth(doc).map(|b| Cow::Owned(Value::Bool(b))),
        }
    }
}

fn compare(a: Option<&Value>, op: Cmp, b: Option<&Value>) -> Option<bool> {
    let (a, b) = (a?, b?);
    // Scalars compare directly (the same order as their index encodings); arrays and
    // objects by their encodings. Values of different types are not comparable.
    let o = match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            x.as_f64().unwrap_or(0.0).partial_cmp(&y.as_f64().unwrap_or(0.0)).unwrap_or(Ordering::Equal)
        }
        (Value::String(x), Value::String(y)) => x.cmp(y),
        (Value::Bool(x), Value::Bool(y)) => x.cmp(y),
        (Value::Array(_), Value::Array(_)) | (Value::Object(_), Value::Object(_)) => keycode::compare(a, b),
        _ => return None,
    };
    Some(match op {
        Cmp::Eq => o.is_eq(),
        Cmp::Ne => o.is_ne(),
        Cmp::Lt => o.is_lt(),
        Cmp::Le => o.is_le(),
        Cmp::Gt => o.is_gt(),
        Cmp::Ge => o.is_ge(),
    })
}

/// SQL LIKE over bytes: `%` any run, `_` one character (one UTF-8 sequence).
fn like(s: &[u8], p: &[u8]) -> bool {
    // Iterative matcher with one backtrack point (the classic wildcard algorithm): linear
    // in practice, no recursion on hostile patterns.
    let (mut si, mut pi) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    let char_len = |b: u8| match b {
        0xF0..=0xFF => 4,
        0xE0..=0xEF => 3,
        0xC0..=0xDF => 2,
        _ => 1,
    };
    while si < s.len() {
        if pi < p.len() && p[pi] == b'%' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == b'_' {
            si += char_len(s[si]);
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            si += 1;
            pi += 1;
        } else if let Some((sp, ss)) = star {
            let next = ss + char_len(s[ss]);
            star = Some((sp, next));
            si = next;
            pi = sp + 1;
        } else {
            return false;
        }
    }
    p[pi.min(p.len())..].iter().all(|&c| c == b'%')
}

fn compile(e: &Expr, depth: usize) -> Result<Filter, FilterError> {
    if depth > FILTER_DEPTH_MAX {
        return Err(FilterError("expression nested too deeply".into()));
    }
    let sub = |e: &Expr| compile(e, depth + 1).map(Box::new);
    Ok(match e {
        Expr::Identifier(id) => Filter::Field(vec![Segment::Key(id.value.clone())]),
        Expr::CompoundIdentifier(ids) => Filter::Field(ids.iter().map(|id| Segment::Key(id.value.clone())).collect()),
        Expr::Value(v) => Filter::Literal(literal(&v.value)?),
        Expr::Nested(inner) => compile(inner, depth + 1)?,
        Expr::UnaryOp { op: UnaryOperator::Not, expr } => Filter::Not(sub(expr)?),
        Expr::UnaryOp { op: UnaryOperator::Minus, expr } => Filter::Neg(sub(expr)?),
        Expr::UnaryOp { op: UnaryOperator::Plus, expr } => compile(expr, depth + 1)?,
        Expr::IsNull(a) => Filter::IsNull(sub(a)?, false),
        Expr::IsNotNull(a) => Filter::IsNull(sub(a)?, true),
        Expr::BinaryOp { left, op, right } => {
            let (l, r) = (sub(left)?, sub(right)?);
            let cmp = match op {
                BinaryOperator::And => return Ok(Filter::And(l, r)),
                BinaryOperator::Or => return Ok(Filter::Or(l, r)),
                BinaryOperator::Eq => Cmp::Eq,
                BinaryOperator::NotEq => Cmp::Ne,
                BinaryOperator::Lt => Cmp::Lt,
                BinaryOperator::LtEq => Cmp::Le,
                BinaryOperator::Gt => Cmp::Gt,
                BinaryOperator::GtEq => Cmp::Ge,
                other => return Err(FilterError(format!("operator {other} is not supported"))),
            };
            Filter::Cmp(l, cmp, r)
        }
        Expr::InList { expr, list, negated } => {
            Filter::In(sub(expr)?, list.iter().map(|e| compile(e, depth + 1)).collect::<Result<_, _>>()?, *negated)
        }
        Expr::Between { expr, negated, low, high } => {
            let v = sub(expr)?;
            let inside = Filter::And(Box::new(Filter::Cmp(v.clone(), Cmp::Ge, sub(low)?)), Box::new(Filter::Cmp(v, Cmp::Le, sub(high)?)));
            if *negated {
                Filter::Not(Box::new(inside))
            } else {
                inside
            }
        }
        Expr::Like { negated, any: false, expr, pattern, escape_char: None } => Filter::Like(sub(expr)?, sub(pattern)?, *negated),
        other => return Err(FilterError(format!("`{other}` is not supported in an index's where"))),
    })
}

fn literal(v: &SqlValue) -> Result<Value, FilterError> {
    Ok(match v {
        SqlValue::Number(n, _) => {
            let parsed: Value = serde_json::from_str(n).map_err(|_| FilterError(format!("number {n} out of range")))?;
            if !parsed.is_number() {
                return Err(FilterError(format!("bad number {n}")));
            }
            parsed
        }
        SqlValue::SingleQuotedString(s) => Value::String(s.clone()),
        SqlValue::Boolean(b) => Value::Bool(*b),
        SqlValue::Null => Value::Null,
        other => return Err(FilterError(format!("literal {other} is not supported"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(filter: &str, doc: Value) -> bool {
        Filter::parse(filter).unwrap().matches(&doc)
    }

    #[test]
    fn evaluates() {
        assert!(m("type = 'order'", json!({"type": "order"})));
        assert!(!m("type = 'order'", json!({"type": "user"})));
        assert!(!m("type = 'order'", json!({})));
        assert!(!m("NOT (type = 'order')", json!({})), "unknown stays unknown under NOT");
        assert!(m("a.b > 2 AND c IS NULL", json!({"a": {"b": 3}})));
        assert!(m("n BETWEEN -1 AND 1.5", json!({"n": 1})));
        assert!(m("n NOT IN (1, 2)", json!({"n": 3})));
        assert!(m("s LIKE 'ab%c_'", json!({"s": "abxxcé"})));
        assert!(!m("s LIKE 'ab%c_'", json!({"s": "abxxc"})));
        assert!(m("flag OR x = 1", json!({"flag": true})));
        assert!(m("\"odd name\" <> 'x'", json!({"odd name": "y"})));
        assert!(!m("n = '1'", json!({"n": 1})), "types do not convert");
    }

    #[test]
    fn refuses() {
        for bad in ["", "type =", "a = 1 extra", "f(x)", "a + 1 = 2", "a = 1e999", "SELECT 1", &"(".repeat(500), &"a".repeat(5000)] {
            assert!(Filter::parse(bad).is_err(), "{bad:.40}");
        }
    }
}
