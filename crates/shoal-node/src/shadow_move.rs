//! A partition's analytics rows moved with its file copy (issue 42, item 2; the mechanism
//! is `shoal_query::shadow`'s `transfer`): before it asks for the partition's export, the
//! receiver asks the active for the partition's rows from its shadow (`Op::ShadowExport`),
//! cut from its segments and sent as Arrow batches in the copy stream's framing; once the
//! copy is adopted, the rows become the receiver's segments at the position they hold, and
//! its shadow follows the partition's stream from there. Nothing re-reads the documents.
//!
//! Each record of the stream is one [`Piece`] (its JSON as the key): a batch of rows of one
//! collection and group (an Arrow IPC stream as the value), or a collection's position
//! (no value), which follows its batches.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use shoal_cluster::NodeId;
use shoal_query::shadow::{decode_batch, encode_batch, PartitionRows, SHADOW_MOVE_MAX_BYTES};
use shoal_storage::copy_stream::{CopyHeader, Frame, FrameDecoder};
use shoal_storage::{ExportHeader, FilePiece, PartitionError, StreamPosition};
use tokio::sync::mpsc;

use crate::copy::{background, next_chunk, read_header, send_export, Outgoing, COPY_IDLE_TIMEOUT};
use crate::node::{blocking, ClusterNode};
use crate::peers::Op;
use crate::ClusterError;

/// A replica being built by files asks the active for the partition's analytics rows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShadowExportRequest {
    pub from: NodeId,
    pub partition: u16,
}

/// One record of a shadow export.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "piece", rename_all = "snake_case")]
enum Piece {
    Rows { collection: String, group: Option<String> },
    Position { collection: String, seqno: u64, uuid: u64 },
}

/// The active's side of `Op::ShadowExport`: partition `p`'s rows of every shadow here, as
/// the chunks of a copy stream. Only a member the map names as a replica of a partition
/// this node is active for gets them.
pub(crate) fn serve_shadow_export(
    node: &Arc<ClusterNode>,
    body: &[u8],
) -> Result<mpsc::Receiver<Result<Outgoing, ClusterError>>, ClusterError> {
    let req: ShadowExportRequest = crate::wire::decode(body).map_err(ClusterError::BadMessage)?;
    crate::copy::check_exporter(node, req.from, req.partition)?;
    let (tx, rx) = mpsc::channel(8);
    let node = Arc::clone(node);
    background("shoal-shadow-export", move || {
        let exported = match node.engine.shadows().export_partition(req.partition) {
            Ok(rows) => rows,
            Err(e) => {
                let _ = tx.blocking_send(Err(ClusterError::Storage(e.to_string())));
                return;
            }
        };
        let mut pieces: Vec<Result<FilePiece, PartitionError>> = Vec::new();
        let mut bytes = 0;
        for (collection, rows) in exported {
            for (group, batch) in &rows.batches {
                let key = piece_key(&Piece::Rows { collection: collection.clone(), group: group.clone() });
                match encode_batch(batch) {
                    Ok(value) => {
                        bytes += value.len();
                        pieces.push(Ok(FilePiece::Record(key, value.into())));
                    }
                    Err(e) => pieces.push(Err(PartitionError::Malformed(e.to_string()))),
                }
            }
            let (seqno, uuid) = (rows.position.seqno, rows.position.uuid);
            pieces.push(Ok(FilePiece::Record(piece_key(&Piece::Position { collection, seqno, uuid }), bytes::Bytes::new())));
        }
        let header = CopyHeader {
            export: ExportHeader { partition: req.partition, collections: Vec::new() },
            bytes_estimate: bytes as u64,
            files: None,
        };
        send_export(&node, &tx, &header, Box::new(pieces.into_iter()));
    })?;
    Ok(rx)
}

fn piece_key(piece: &Piece) -> bytes::Bytes {
    serde_json::to_vec(piece).unwrap_or_default().into()
}

/// The receiver's side: partition `p`'s rows of every shadow at `address` (the active),
/// by collection. At most [`SHADOW_MOVE_MAX_BYTES`]; a collection whose position did not
/// come is left out.
pub(crate) async fn fetch(node: &Arc<ClusterNode>, address: &str, p: u16) -> Result<Vec<(String, PartitionRows)>, ClusterError> {
    let body = crate::wire::encode(&ShadowExportRequest { from: node.id, partition: p });
    let mut stream = node.peers.stream(address, Op::ShadowExport, body, COPY_IDLE_TIMEOUT).await?;
    let mut decoder = FrameDecoder::default();
    let header = read_header(&mut stream, &mut decoder, |_| {}).await?;
    if header.export.partition != p {
        return Err(ClusterError::BadMessage(format!("asked for the analytics rows of partition {p}, got {}", header.export.partition)));
    }
    let mut batches: Vec<(String, Option<String>, bytes::Bytes)> = Vec::new();
    let mut done: Vec<(String, StreamPosition)> = Vec::new();
    let mut bytes = 0usize;
    let bad = |e: shoal_storage::copy_stream::FrameError| ClusterError::BadMessage(e.to_string());
    loop {
        match decoder.next_frame().map_err(bad)? {
            Some(Frame::Record(key, value)) => {
                bytes += value.len();
                if bytes > SHADOW_MOVE_MAX_BYTES {
                    return Err(ClusterError::Refused(format!(
                        "partition {p}'s analytics rows exceed {SHADOW_MOVE_MAX_BYTES} bytes; they are built from the change stream"
                    )));
                }
                match serde_json::from_slice::<Piece>(&key).map_err(|e| ClusterError::BadMessage(e.to_string()))? {
                    Piece::Rows { collection, group } => batches.push((collection, group, value)),
                    Piece::Position { collection, seqno, uuid } => done.push((collection, StreamPosition { seqno, uuid })),
                }
            }
            Some(Frame::End) => break,
            Some(Frame::Header(_)) => return Err(ClusterError::BadMessage("a second header".into())),
            None => match next_chunk(&mut stream).await? {
                Some(chunk) => decoder.push_bytes(chunk),
                None => return Err(ClusterError::BadMessage("the analytics rows ended before their end marker".into())),
            },
        }
    }
    // The batches are decoded off the runtime's threads.
    blocking(move || {
        let mut out = Vec::with_capacity(done.len());
        for (collection, position) in done {
            let mut rows = PartitionRows { position, batches: Vec::new() };
            for (_, group, value) in batches.iter().filter(|(c, _, _)| *c == collection) {
                rows.batches.push((group.clone(), decode_batch(value).map_err(|e| ClusterError::BadMessage(e.to_string()))?));
            }
            out.push((collection, rows));
        }
        Ok(out)
    })
    .await?
}

/// Makes `rows` partition `p`'s analytics rows here (blocking: writes segments). Answers
/// the rows adopted; a collection without a shadow here is skipped (its rows are built
/// from the stream if it gets one).
pub(crate) fn adopt(node: &ClusterNode, p: u16, rows: Vec<(String, PartitionRows)>) -> Result<u64, ClusterError> {
    let store = node.engine.store();
    let mut adopted = 0u64;
    for (collection, rows) in rows {
        let Some(coll) = store.collection(&collection) else { continue };
        let Some(shadow) = node.engine.shadows().shadow(coll.id()) else { continue };
        let n = shadow.adopt_partition(p, rows).map_err(|e| ClusterError::Storage(e.to_string()))?;
        adopted += n as u64;
    }
    Ok(adopted)
}
