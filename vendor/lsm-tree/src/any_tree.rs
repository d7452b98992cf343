// Copyright (c) 2024-present, fjall-rs
// This source code is licensed under both the Apache 2.0 and MIT License
// (found in the LICENSE-* files in the repository)

use crate::{BlobTree, Tree};
use enum_dispatch::enum_dispatch;

/// May be a standard [`Tree`] or a [`BlobTree`]
#[derive(Clone)]
#[enum_dispatch(AbstractTree)]
pub enum AnyTree {
    /// Standard LSM-tree, see [`Tree`]
    Standard(Tree),

    /// Key-value separated LSM-tree, see [`BlobTree`]
    Blob(BlobTree),
}

// SHOAL-PATCH: file export and import (`tree/import.rs`); a blob tree's files are its
// index tree's version (tables and blob files alike).
impl AnyTree {
    fn base(&self) -> &Tree {
        match self {
            Self::Standard(t) => t,
            Self::Blob(b) => &b.index,
        }
    }

    /// See [`Tree::export_at`].
    ///
    /// # Errors
    ///
    /// See [`Tree::export_at`].
    pub fn export_at(&self, seqno: crate::SeqNo) -> crate::Result<crate::TreeExport> {
        self.base().export_at(seqno)
    }

    /// See [`Tree::import`].
    ///
    /// # Errors
    ///
    /// See [`Tree::import`].
    pub fn import(
        &self,
        manifest: &crate::ImportManifest,
        memtable: Vec<crate::InternalValue>,
    ) -> crate::Result<Option<crate::PreparedImport>> {
        self.base().import(manifest, memtable)
    }
}
