//! The local-directory backend (`EXPORTD_DATA_DIR/objects`), the default on one machine.
//!
//! Objects are written to `tmp/`, fsynced and renamed into place, so an object either exists
//! whole or not at all. Blocking calls: the store runs them on the blocking pool.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use uuid::Uuid;

use super::{ObjectKey, StoredObject};

const WRITE_BUFFER_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone)]
pub(super) struct LocalDir {
    root: PathBuf,
    objects: PathBuf,
    tmp: PathBuf,
}

impl LocalDir {
    pub(super) fn open(data_dir: &Path) -> io::Result<LocalDir> {
        let dir = LocalDir { root: data_dir.to_owned(), objects: data_dir.join("objects"), tmp: data_dir.join("tmp") };
        fs::create_dir_all(&dir.objects)?;
        fs::create_dir_all(&dir.tmp)?;
        Ok(dir)
    }

    pub(super) fn describe(&self) -> String {
        format!("file://{}", fs::canonicalize(&self.root).unwrap_or_else(|_| self.root.clone()).display())
    }

    /// The objects directory is there and readable.
    pub(super) fn check(&self) -> io::Result<()> {
        fs::read_dir(&self.objects).map(|_| ())
    }

    fn path(&self, key: &ObjectKey) -> PathBuf {
        self.objects.join(key.as_str())
    }

    pub(super) fn writer(&self, key: &ObjectKey) -> io::Result<LocalWriter> {
        let temp = self.tmp.join(format!("{}.part", Uuid::new_v4()));
        let file = File::create_new(&temp)?;
        let file = Some(BufWriter::with_capacity(WRITE_BUFFER_BYTES, file));
        Ok(LocalWriter { file, temp, target: self.path(key) })
    }

    /// The file positioned at `offset`, limited to `len` bytes.
    pub(super) fn open_range(&self, key: &ObjectKey, offset: u64, len: u64) -> io::Result<io::Take<File>> {
        use std::io::Seek;
        let mut file = File::open(self.path(key))?;
        file.seek(io::SeekFrom::Start(offset))?;
        Ok(file.take(len))
    }

    pub(super) fn digest(&self, key: &ObjectKey) -> io::Result<Option<(u64, String)>> {
        match File::open(self.path(key)) {
            Ok(file) => sha256_of(file).map(Some),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A small object's bytes, or `None` when it does not exist.
    pub(super) fn read_all(&self, key: &ObjectKey) -> io::Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes a small object only if none exists (a hard link fails on an existing name, so
    /// two writers cannot both succeed). Returns whether this call created it.
    pub(super) fn create(&self, key: &ObjectKey, bytes: &[u8]) -> io::Result<bool> {
        let temp = self.tmp.join(format!("{}.part", Uuid::new_v4()));
        let mut file = File::create_new(&temp)?;
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        let target = self.path(key);
        let dir = target.parent().expect("object keys are relative paths under the root");
        let linked = written.and_then(|()| fs::create_dir_all(dir)).and_then(|()| fs::hard_link(&temp, &target));
        let _ = fs::remove_file(&temp);
        match linked {
            Ok(()) => File::open(dir)?.sync_all().map(|()| true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(super) fn delete(&self, key: &ObjectKey) -> io::Result<u64> {
        let path = self.path(key);
        let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        Ok(if remove_if_present(&path)? { len } else { 0 })
    }

    /// Every object under `prefix` (all of them for `None`), recursively.
    pub(super) fn list(&self, prefix: Option<&ObjectKey>) -> io::Result<Vec<StoredObject>> {
        let mut out = Vec::new();
        let start = prefix.map_or_else(|| self.objects.clone(), |p| self.path(p));
        walk(&start, &self.objects, &mut out)?;
        Ok(out)
    }

    /// Removes the directories emptied by deletions under `prefix` (best effort).
    pub(super) fn prune(&self, prefix: &ObjectKey) {
        let _ = fs::remove_dir_all(self.path(prefix)).or_else(|e| match e.kind() {
            io::ErrorKind::NotFound => Ok(()),
            _ => Err(e),
        });
    }

    /// Deletes temp files not written to for `age` (left by writers that crashed).
    pub(super) fn sweep_abandoned(&self, age: Duration) -> io::Result<(u64, u64)> {
        let (mut files, mut bytes) = (0, 0);
        for entry in read_dir(&self.tmp)? {
            let Ok(meta) = entry.metadata() else { continue };
            let idle = meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok());
            if idle.is_some_and(|idle| idle > age) && remove_if_present(&entry.path())? {
                files += 1;
                bytes += meta.len();
            }
        }
        Ok((files, bytes))
    }
}

/// An object being written: a temp file that becomes the object on [`LocalWriter::finish`],
/// and is removed when dropped before that.
pub(super) struct LocalWriter {
    /// `None` once finished.
    file: Option<BufWriter<File>>,
    temp: PathBuf,
    target: PathBuf,
}

impl LocalWriter {
    /// fsync, rename into place, fsync the directory.
    pub(super) fn finish(mut self) -> io::Result<()> {
        let file = self.file.take().expect("finished once").into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        let dir = self.target.parent().expect("object keys are relative paths under the root");
        fs::create_dir_all(dir)?;
        if let Err(e) = fs::rename(&self.temp, &self.target) {
            let _ = fs::remove_file(&self.temp);
            return Err(e);
        }
        File::open(dir)?.sync_all()
    }

    fn file(&mut self) -> &mut BufWriter<File> {
        self.file.as_mut().expect("not finished")
    }
}

impl Drop for LocalWriter {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

impl Write for LocalWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file().flush()
    }
}

/// Size and lowercase hex sha256 of everything `reader` yields.
pub(super) fn sha256_of(mut reader: impl Read) -> io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut bytes = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            return Ok((bytes, hex::encode(hasher.finalize())));
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<StoredObject>) -> io::Result<()> {
    for entry in read_dir(dir)? {
        let meta = entry.metadata()?;
        let path = entry.path();
        if meta.is_dir() {
            walk(&path, root, out)?;
        } else if let Some(key) =
            path.strip_prefix(root).ok().and_then(|p| p.to_str()).and_then(|p| ObjectKey::parse(p).ok())
        {
            out.push(StoredObject { key, bytes: meta.len() });
        }
    }
    Ok(())
}

fn read_dir(dir: &Path) -> io::Result<Vec<fs::DirEntry>> {
    match fs::read_dir(dir) {
        Ok(entries) => entries.collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn remove_if_present(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}
