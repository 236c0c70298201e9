//! The artifact store: shard files in a local directory (`EXPORTD_DATA_DIR/objects`).
//!
//! Files are written to `tmp/`, fsynced and renamed into place, so an object either exists
//! whole or not at all. Object keys are validated relative paths and can never leave the root.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// A relative object path of `[A-Za-z0-9._-]` segments (no `..`, no empty segment).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey(String);

impl ObjectKey {
    pub fn parse(text: &str) -> Result<ObjectKey, String> {
        let valid_segment = |s: &str| {
            !s.is_empty() && s != "." && s != ".." && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        };
        if text.len() <= 512 && text.split('/').all(valid_segment) {
            Ok(ObjectKey(text.to_owned()))
        } else {
            Err(format!("`{text}` is not a valid object key"))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone)]
pub struct ArtifactStore {
    objects: PathBuf,
    tmp: PathBuf,
}

impl ArtifactStore {
    /// Opens (creating) the store under `data_dir`.
    pub fn open(data_dir: &Path) -> io::Result<ArtifactStore> {
        let store = ArtifactStore { objects: data_dir.join("objects"), tmp: data_dir.join("tmp") };
        fs::create_dir_all(&store.objects)?;
        fs::create_dir_all(&store.tmp)?;
        Ok(store)
    }

    /// A new temporary file to write an object into before [`ArtifactStore::persist`].
    pub fn temp_file(&self) -> io::Result<(PathBuf, File)> {
        let path = self.tmp.join(format!("{}.part", Uuid::new_v4()));
        let file = File::create_new(&path)?;
        Ok((path, file))
    }

    /// Makes a finished temp file the object `key`: fsync, rename, fsync the directory.
    pub fn persist(&self, temp: &Path, file: File, key: &ObjectKey) -> io::Result<()> {
        file.sync_all()?;
        drop(file);
        let target = self.path(key);
        let dir = target.parent().expect("object keys are relative paths under the root");
        fs::create_dir_all(dir)?;
        fs::rename(temp, &target)?;
        File::open(dir)?.sync_all()
    }

    pub fn path(&self, key: &ObjectKey) -> PathBuf {
        self.objects.join(&key.0)
    }

    pub fn open_object(&self, key: &ObjectKey) -> io::Result<File> {
        File::open(self.path(key))
    }

    /// Size and sha256 of an object, or `None` when it does not exist.
    pub fn digest(&self, key: &ObjectKey) -> io::Result<Option<(u64, String)>> {
        file_digest(&self.path(key))
    }

    /// Deletes an object; a missing one is fine. Returns the bytes freed.
    pub fn delete(&self, key: &ObjectKey) -> io::Result<u64> {
        let path = self.path(key);
        match fs::metadata(&path) {
            Ok(meta) => {
                fs::remove_file(&path)?;
                Ok(meta.len())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Deletes every object under `prefix/` (e.g. one export's directory). Returns (files, bytes)
    /// freed.
    pub fn delete_prefix_counted(&self, prefix: &ObjectKey) -> io::Result<(u64, u64)> {
        let dir = self.path(prefix);
        let (files, bytes) = dir_size(&dir)?;
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok((files, bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((0, 0)),
            Err(e) => Err(e),
        }
    }

    /// Every `(tenant, export)` directory pair under the root.
    pub fn list_export_dirs(&self) -> io::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for tenant in read_dir_names(&self.objects)? {
            for export in read_dir_names(&self.objects.join(&tenant))? {
                out.push((tenant.clone(), export));
            }
        }
        Ok(out)
    }

    /// Deletes the files `<prefix>/<generation>/<name>` for which `doomed(key, generation)` holds.
    /// Returns (files, bytes) freed.
    pub fn delete_matching(&self, prefix: &str, doomed: impl Fn(&str, &str) -> bool) -> io::Result<(u64, u64)> {
        let (mut files, mut bytes) = (0, 0);
        let dir = self.objects.join(prefix);
        for generation in read_dir_names(&dir)? {
            for name in read_dir_names(&dir.join(&generation))? {
                let key = format!("{prefix}/{generation}/{name}");
                if doomed(&key, &generation) {
                    let path = dir.join(&generation).join(&name);
                    let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    if remove_if_present(&path)? {
                        files += 1;
                        bytes += len;
                    }
                }
            }
        }
        Ok((files, bytes))
    }

    /// Deletes temp files older than `age` (left by writers that crashed). Returns (files, bytes).
    pub fn delete_temp_older_than(&self, age: std::time::Duration) -> io::Result<(u64, u64)> {
        let (mut files, mut bytes) = (0, 0);
        for name in read_dir_names(&self.tmp)? {
            let path = self.tmp.join(name);
            if crate::cleaner::older_than(&path, age) {
                let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                if remove_if_present(&path)? {
                    files += 1;
                    bytes += len;
                }
            }
        }
        Ok((files, bytes))
    }
}

/// Size and lowercase hex sha256 of a file, or `None` when it does not exist (blocking).
pub fn file_digest(path: &Path) -> io::Result<Option<(u64, String)>> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(Some((bytes, hex::encode(hasher.finalize()))))
}

fn remove_if_present(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn read_dir_names(dir: &Path) -> io::Result<Vec<String>> {
    match fs::read_dir(dir) {
        Ok(entries) => Ok(entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// (files, bytes) under `dir`, recursively.
fn dir_size(dir: &Path) -> io::Result<(u64, u64)> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(e) => return Err(e),
    };
    let (mut files, mut bytes) = (0, 0);
    for entry in entries {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_dir() {
            let (f, b) = dir_size(&entry.path())?;
            files += f;
            bytes += b;
        } else {
            files += 1;
            bytes += meta.len();
        }
    }
    Ok((files, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn object_keys_cannot_escape_the_root() {
        assert!(ObjectKey::parse("acme/0f0e/g1/shard-00000.csv.gz").is_ok());
        for bad in ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "a b", "a\\b"] {
            assert!(ObjectKey::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn persisted_objects_appear_whole_and_can_be_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let store = ArtifactStore::open(dir.path()).unwrap();
        let key = ObjectKey::parse("t/e/g1/shard-00000.csv.gz").unwrap();
        let (temp, mut file) = store.temp_file().unwrap();
        file.write_all(b"hello").unwrap();
        assert_eq!(store.digest(&key).unwrap(), None, "not visible before persist");
        store.persist(&temp, file, &key).unwrap();
        let (bytes, sha) = store.digest(&key).unwrap().unwrap();
        assert_eq!(bytes, 5);
        assert_eq!(sha, "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824");
        assert!(!temp.exists());
        assert_eq!(store.delete_prefix_counted(&ObjectKey::parse("t/e").unwrap()).unwrap(), (1, 5));
        assert_eq!(store.digest(&key).unwrap(), None);
    }
}
