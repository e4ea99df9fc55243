//! Certificates for TLS tests, made with the `openssl` command: a CA, and leaf certificates it signs
//! for `localhost` (server) or a client name, as PEM files in a directory the caller owns.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test CA and what it signed.
pub struct TestCa {
    pub dir: PathBuf,
    pub ca_cert: PathBuf,
    ca_key: PathBuf,
}

/// A signed certificate and its key.
pub struct Leaf {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("the openssl command (Debian package openssl)");
    assert!(out.status.success(), "openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl TestCa {
    /// A new CA (`name` in its subject) in `dir`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        std::fs::create_dir_all(dir).unwrap();
        let subj = format!("/CN={name}");
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &subj,
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        );
        TestCa { dir: dir.to_path_buf(), ca_cert: dir.join("ca.pem"), ca_key: dir.join("ca.key") }
    }

    /// A leaf for `cn`, valid for the DNS name `cn` and 127.0.0.1, for servers (`server`) or clients.
    pub fn leaf(&self, cn: &str, server: bool) -> Leaf {
        let dir = &self.dir;
        let (key, csr, cert, ext) = (format!("{cn}.key"), format!("{cn}.csr"), format!("{cn}.pem"), format!("{cn}.ext"));
        let usage = if server { "serverAuth" } else { "clientAuth" };
        std::fs::write(
            dir.join(&ext),
            format!("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage={usage}\nsubjectAltName=DNS:{cn},IP:127.0.0.1\n"),
        )
        .unwrap();
        openssl(dir, &["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", &format!("/CN={cn}"), "-keyout", &key, "-out", &csr]);
        let (ca, ca_key) = (self.ca_cert.to_str().unwrap(), self.ca_key.to_str().unwrap());
        openssl(dir, &["x509", "-req", "-in", &csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-extfile", &ext, "-out", &cert]);
        // Readable by a broker that runs as another user (tests only; the directory is the test's own).
        let key_path = dir.join(&key);
        let _ = std::fs::set_permissions(&key_path, std::os::unix::fs::PermissionsExt::from_mode(0o644));
        Leaf { cert: dir.join(cert), key: key_path }
    }
}
