//! `shoal cert`: a CA and node certificates for trying TLS out without an outside CA.
//!
//! The first run in a directory makes the CA (`ca.pem`, `ca-key.pem`); every run signs a
//! node certificate (`<name>.pem`, `<name>-key.pem`) for the hosts given, usable by a node
//! as its server certificate and, towards other members, as its client certificate. Keys
//! are written readable by their owner only. rcgen (with `ring`) makes them: no openssl.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};

use crate::cli::CliError;

/// How long `shoal cert`'s CA is valid.
pub const CA_VALID_DAYS: i64 = 3650;
/// How long a node certificate is valid unless `--days` says otherwise (what browsers
/// accept at most, 825 days).
pub const NODE_VALID_DAYS_DEFAULT: i64 = 825;

#[derive(clap::Args)]
pub struct CertArgs {
    /// Where the CA and the certificates are (the CA is made on the first run).
    #[arg(long, default_value = "shoal-tls")]
    dir: PathBuf,
    /// A name or IP address the node is reached at (repeat for more); the address in
    /// `--advertise` must be one of them.
    #[arg(long = "host", required = true)]
    hosts: Vec<String>,
    /// The files' name: `<name>.pem` and `<name>-key.pem`.
    #[arg(long, default_value = "node")]
    name: String,
    /// Days the node certificate is valid.
    #[arg(long, default_value_t = NODE_VALID_DAYS_DEFAULT)]
    days: i64,
}

fn failed(what: &str, e: impl std::fmt::Display) -> CliError {
    CliError::Usage(format!("{what}: {e}"))
}

/// Writes `contents` to `path`, readable by its owner only when `secret`.
fn write(path: &Path, contents: &str, secret: bool) -> Result<(), CliError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if secret {
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|e| failed(&format!("cannot write {}", path.display()), e))?;
    file.write_all(contents.as_bytes()).map_err(|e| failed(&format!("cannot write {}", path.display()), e))
}

fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    // An hour back: a member whose clock is a little behind still accepts it.
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days);
}

/// The CA in `dir`, made if it is not there.
fn ca(dir: &Path) -> Result<(Issuer<'static, KeyPair>, bool), CliError> {
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
    if cert_path.exists() || key_path.exists() {
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| failed(&format!("cannot read {}", p.display()), e));
        let key = KeyPair::from_pem(&read(&key_path)?).map_err(|e| failed(&format!("{}", key_path.display()), e))?;
        let issuer = Issuer::from_ca_cert_pem(&read(&cert_path)?, key).map_err(|e| failed(&format!("{}", cert_path.display()), e))?;
        return Ok((issuer, false));
    }
    let key = KeyPair::generate().map_err(|e| failed("cannot make a key", e))?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, format!("Shoal CA {}", uuid_like()));
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut params, CA_VALID_DAYS);
    let cert = params.self_signed(&key).map_err(|e| failed("cannot make the CA", e))?;
    write(&key_path, &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok((Issuer::new(params, key), true))
}

/// A short random tag, so that two CAs made apart have different names.
fn uuid_like() -> String {
    format!("{:08x}", rand::random::<u32>())
}

pub fn run(args: CertArgs) -> Result<(), CliError> {
    if args.days < 1 {
        return Err(CliError::Usage("--days must be at least 1".into()));
    }
    if args.name.is_empty() || args.name.contains('/') || args.name == "ca" {
        return Err(CliError::Usage("--name: a file name other than `ca`, without `/`".into()));
    }
    std::fs::create_dir_all(&args.dir).map_err(|e| failed(&format!("cannot create {}", args.dir.display()), e))?;
    let (issuer, made) = ca(&args.dir)?;
    let key = KeyPair::generate().map_err(|e| failed("cannot make a key", e))?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, args.hosts[0].clone());
    params.distinguished_name = name;
    for host in &args.hosts {
        let san = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(host.clone().try_into().map_err(|e| failed(&format!("--host {host}"), e))?),
        };
        params.subject_alt_names.push(san);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    // A node is a server to its clients and a client of the other members.
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, args.days);
    let cert = params.signed_by(&key, &issuer).map_err(|e| failed("cannot sign the certificate", e))?;
    let (cert_path, key_path) = (args.dir.join(format!("{}.pem", args.name)), args.dir.join(format!("{}-key.pem", args.name)));
    write(&key_path, &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    let ca_path = args.dir.join("ca.pem");
    if made {
        eprintln!("shoal: made a CA in {} (keep ca-key.pem safe: it signs members)", args.dir.display());
    }
    println!("--tls-cert {} --tls-key {} --tls-ca {}", cert_path.display(), key_path.display(), ca_path.display());
    Ok(())
}
