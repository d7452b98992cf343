//! openraft's own storage test suite (`openraft::testing::Suite`), run against the
//! file-backed log store and state machine: a check of the Raft storage contract that no one
//! here wrote.

use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;
use shoal_meta::{open_storage, MetaLogStore, MetaStateMachine, TypeConfig};
use tempfile::TempDir;

struct FileStoreBuilder;

impl StoreBuilder<TypeConfig, MetaLogStore, MetaStateMachine, TempDir> for FileStoreBuilder {
    async fn build(&self) -> Result<(TempDir, MetaLogStore, MetaStateMachine), StorageError<u64>> {
        let dir = TempDir::new().unwrap();
        let (log, sm) = open_storage(dir.path()).unwrap();
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(FileStoreBuilder).unwrap();
}
