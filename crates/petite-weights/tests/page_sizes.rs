//! Page-dependent paths with the page size as a parameter: layouts planned for 4, 16 and 64 KiB
//! pages, and releases rounded to each of them (real `madvise` calls: on a 4 KiB host a 16 or
//! 64 KiB-aligned range is still page-aligned), in every combination of layout page and release
//! page. Own test binary, so no other test maps files in this process meanwhile (the RSS figures
//! are per mapping anyway).

use std::io::Write;

use petite_weights::{
    Dtype, MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource, page, page_size,
};

/// Linux page sizes on x86-64 and aarch64; those smaller than this host's are skipped for
/// releases (madvise would refuse them), never for layouts.
const PAGES: [usize; 3] = [4 << 10, 16 << 10, 64 << 10];

fn table() -> Vec<TensorSpec> {
    let mut t = Vec::new();
    for i in 0..6 {
        // 256 KiB + i × 4 KiB: a multiple of 4 KiB, of 64 KiB only for i = 0.
        t.push(TensorSpec::new(
            format!("big{i}"),
            Dtype::F32,
            &[64 * 1024 + i * 1024],
        ));
        // ~80 KiB, odd-sized: large, never a page multiple.
        t.push(TensorSpec::new(
            format!("odd{i}"),
            Dtype::Bf16,
            &[40_000 + 2 * i + 1],
        ));
        t.push(TensorSpec::new(format!("small{i}"), Dtype::F32, &[3 + i]));
    }
    t
}

fn bytes_of(k: usize, n: usize) -> Vec<u8> {
    (0..n).map(|j| (j * 31 + k * 7) as u8).collect()
}

fn write(path: &std::path::Path, layout_page: usize) -> Vec<TensorSpec> {
    let table = table();
    let w = SafetensorsWriter::create_for_page(path, &table, &[], layout_page).unwrap();
    assert_eq!(
        w.data_start() % layout_page as u64,
        0,
        "data region on a page"
    );
    for (k, t) in table.iter().enumerate() {
        let n: usize = t.shape.iter().product::<usize>() * t.dtype.size();
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&bytes_of(k, n)).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    table
}

#[test]
fn layouts_are_aligned_to_the_page_they_are_planned_for() {
    let dir = tempfile::tempdir().unwrap();
    for layout in PAGES {
        let p = dir.path().join(format!("l{layout}.safetensors"));
        let table = write(&p, layout);
        let m = MappedSafetensors::open(&p).unwrap();
        let mut first_odd = None;
        for (k, t) in table.iter().enumerate() {
            let r = m.file_range(&t.name).unwrap();
            assert_eq!(m.tensor(&t.name).unwrap().bytes, &bytes_of(k, r.len())[..]);
            if r.len().is_multiple_of(layout) {
                assert_eq!(r.start % layout, 0, "{} at page {layout}", t.name);
            } else {
                first_odd = Some(first_odd.map_or(r.start, |s: usize| s.min(r.start)));
            }
            // Every tensor stays aligned to its element size whatever the page.
            assert_eq!(r.start % t.dtype.size(), 0, "{}", t.name);
        }
        // The page-multiple tensors come first and end on a page: the first other one starts
        // on a page too.
        let s = first_odd.expect("tensors that are no page multiple");
        assert_eq!(
            s % layout,
            0,
            "first non-page-multiple tensor on a page ({layout})"
        );
    }
    let e = SafetensorsWriter::create_for_page(dir.path().join("x"), &table(), &[], 3 << 12)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a power of two"), "{e}");
}

#[test]
fn releases_at_every_page_size_drop_whole_pages_only() {
    let os = page_size();
    let dir = tempfile::tempdir().unwrap();
    for layout in PAGES {
        let p = dir.path().join(format!("r{layout}.safetensors"));
        let table = write(&p, layout);
        for release in PAGES.into_iter().filter(|&r| r >= os) {
            let m = MappedSafetensors::open(&p)
                .unwrap()
                .with_page_size(release)
                .unwrap();
            assert_eq!(m.page_size(), release);
            let sums: Vec<Vec<u8>> = table
                .iter()
                .map(|t| m.tensor(&t.name).unwrap().bytes.to_vec())
                .collect();
            let full = m.process_resident_bytes().expect("procfs");
            assert_eq!(
                full as usize,
                m.mapped_len().div_ceil(os) * os,
                "all mapped"
            );

            // Release every other tensor: exactly their whole pages (rounded inward to the
            // release page) leave the process.
            let released: Vec<&str> = table.iter().map(|t| t.name.as_str()).step_by(2).collect();
            let expect: usize = released
                .iter()
                .map(|n| page::inward(m.file_range(n).unwrap(), release).len())
                .sum();
            m.release(&released).unwrap();
            let after = m.process_resident_bytes().unwrap();
            assert_eq!(
                (full - after) as usize,
                expect,
                "layout {layout}, release {release}: dropped vs whole pages inside the tensors"
            );
            // No page of a kept tensor went: reading them all faults nothing back in.
            for (k, t) in table.iter().enumerate().skip(1).step_by(2) {
                assert_eq!(m.tensor(&t.name).unwrap().bytes, &sums[k][..]);
            }
            assert_eq!(
                m.process_resident_bytes().unwrap(),
                after,
                "layout {layout}, release {release}: a kept tensor's page was released"
            );
            // Released tensors still read (they fault back in from the file).
            for (k, t) in table.iter().enumerate().step_by(2) {
                assert_eq!(m.tensor(&t.name).unwrap().bytes, &sums[k][..], "{}", t.name);
            }

            // A range release rounds outward, inside the mapping; an unmap likewise. On a fresh
            // mapping with every page mapped: a release also unmaps the released ranges nearby
            // (`FOLIO_SPAN`), and the ones above were read back in.
            drop(m);
            let m = MappedSafetensors::open(&p)
                .unwrap()
                .with_page_size(release)
                .unwrap();
            for t in &table {
                m.tensor(&t.name).unwrap().bytes.iter().for_each(|&b| {
                    std::hint::black_box(b);
                });
            }
            let full = m.process_resident_bytes().unwrap();
            let r = m.file_range("big3").unwrap();
            let (a, b) = (1000, r.len() - 1000);
            // The kernel rounds a length ending at a partial last page up to the OS page.
            let expect = page::align_up(
                page::outward(r.start + a..r.start + b, release, m.mapped_len()).len() as u64,
                os as u64,
            ) as usize;
            m.release_range("big3", a, b).unwrap();
            let after = m.process_resident_bytes().unwrap();
            assert_eq!(
                (full - after) as usize,
                expect,
                "release_range at {release}"
            );
            assert_eq!(m.tensor("big3").unwrap().bytes, &sums[9][..]);
            let full = m.process_resident_bytes().unwrap();
            let r = m.file_range("odd5").unwrap();
            let one = page::outward(r.start..r.start + 1, release, m.mapped_len());
            assert!(one.len() <= release && one.start.is_multiple_of(release));
            m.unmap_range("odd5", 0, 1).unwrap();
            let after = m.process_resident_bytes().unwrap();
            assert_eq!(
                (full - after) as usize,
                page::align_up(one.len() as u64, os as u64) as usize,
                "unmap of one byte: its page at {release}"
            );
        }
    }
}

#[test]
fn a_page_below_the_os_page_is_refused() {
    let os = page_size();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.safetensors");
    write(&p, os);
    let e = MappedSafetensors::open(&p)
        .unwrap()
        .with_page_size(os / 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of the OS page"), "{e}");
    assert!(
        MappedSafetensors::open(&p)
            .unwrap()
            .with_page_size(3 * os)
            .is_err()
    );
}

/// A region mapping (an engine inside a `.pte`) starts on an OS page that need not be a
/// multiple of a coarser release page: releases and unmaps rounded to 16 or 64 KiB are clamped to
/// what is mapped (a range below the mapping would be another mapping's memory), drop exactly the
/// clamped pages, and every byte still reads.
#[test]
fn region_releases_at_coarser_pages_stay_inside_the_mapping() {
    use petite_weights::Role;
    let os = page_size();
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("e.safetensors");
    let table = write(&st, os);
    let inner = std::fs::read(&st).unwrap();
    for offset in [3 * os, 5 * os + 100] {
        let outer = dir.path().join(format!("outer-{offset}.bin"));
        let mut bytes = vec![0xAAu8; offset];
        bytes.extend_from_slice(&inner);
        std::fs::write(&outer, &bytes).unwrap();
        for release in PAGES.into_iter().filter(|&r| r >= os) {
            let m = MappedSafetensors::open_region(
                &outer,
                Role::File,
                offset as u64,
                inner.len() as u64,
            )
            .unwrap()
            .with_page_size(release)
            .unwrap();
            let want: Vec<Vec<u8>> = table
                .iter()
                .map(|t| m.tensor(&t.name).unwrap().bytes.to_vec())
                .collect();
            // The first tensor from its first byte: rounded down to `release` it would start
            // below the mapping whenever the region's page is not a `release` multiple.
            let first = &table
                .iter()
                .min_by_key(|t| m.file_range(&t.name).unwrap().start)
                .unwrap()
                .name;
            let r = m.file_range(first).unwrap();
            let map_start = offset / os * os;
            let map_end = map_start + m.mapped_len();
            let full = m.process_resident_bytes().expect("procfs");
            m.release_range(first, 0, r.len()).unwrap();
            let p = page::outward(r.clone(), release, map_end);
            let expect = page::align_up((p.end - p.start.max(map_start)) as u64, os as u64);
            let after = m.process_resident_bytes().unwrap();
            assert_eq!(
                full - after,
                expect,
                "offset {offset}, release page {release}"
            );
            m.unmap_range(first, 0, 1).unwrap();
            for (k, t) in table.iter().enumerate() {
                assert_eq!(m.tensor(&t.name).unwrap().bytes, &want[k][..], "{}", t.name);
            }
        }
    }
}

/// Whether each OS page of `bytes` is mapped in this process (`/proc/self/pagemap`'s present
/// bit; readable without privileges).
fn pages_mapped(bytes: &[u8]) -> Vec<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let os = page_size();
    let first = bytes.as_ptr() as usize / os;
    let last = (bytes.as_ptr() as usize + bytes.len()).div_ceil(os);
    let mut f = std::fs::File::open("/proc/self/pagemap").expect("procfs");
    f.seek(SeekFrom::Start(first as u64 * 8)).unwrap();
    let mut buf = vec![0u8; (last - first) * 8];
    f.read_exact(&mut buf).unwrap();
    buf.chunks(8)
        .map(|e| u64::from_le_bytes(e.try_into().unwrap()) >> 63 == 1)
        .collect()
}

/// A fault on a small tensor can map its released neighbours' pages back in (a large folio is
/// mapped whole; fault-around maps 64 KiB): releasing it unmaps every released range nearby
/// again, and no page of a tensor never released. Simulated by reading the released neighbours
/// back, then releasing the small tensor between them.
#[test]
fn a_release_unmaps_released_neighbours_mapped_again() {
    let os = page_size();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("n.safetensors");
    write(&p, os);
    let m = MappedSafetensors::open(&p).unwrap();
    let touch = |name: &str| {
        m.tensor(name).unwrap().bytes.iter().for_each(|&b| {
            std::hint::black_box(b);
        })
    };
    // Whole pages inside `name`, as a byte slice of the mapping.
    let inside = |name: &str| {
        let t = m.tensor(name).unwrap().bytes;
        let r = m.file_range(name).unwrap();
        let i = page::inward(r.clone(), os);
        if i.is_empty() {
            return &t[..0];
        }
        &t[i.start - r.start..i.end - r.start]
    };
    // a small tensor b; two tensors a, c with whole pages of their own in b's FOLIO_SPAN; a
    // third there, never released
    let span = |n: &str| m.file_range(n).unwrap().start / petite_weights::FOLIO_SPAN;
    let b = "small3";
    let near: Vec<String> = m
        .names()
        .into_iter()
        .filter(|n| n != b && !inside(n).is_empty() && span(n) == span(b))
        .filter(|n| {
            let r = page::inward(m.file_range(n).unwrap(), os);
            (r.end - 1) / petite_weights::FOLIO_SPAN == span(b)
        })
        .collect();
    assert!(near.len() >= 3, "{near:?}");
    let (a, c, kept) = (near[0].as_str(), near[1].as_str(), near[2].as_str());
    let order = m.names();
    touch(kept);
    let others: Vec<&str> = order
        .iter()
        .map(String::as_str)
        .filter(|n| *n != kept)
        .collect();
    m.release(&others).unwrap();
    for t in [a, c] {
        assert!(!pages_mapped(inside(t)).iter().any(|&x| x), "{t} released");
    }
    // the neighbours' pages come back (as a large folio would bring them), then b is released
    for t in [a, c, b] {
        touch(t);
    }
    for t in [a, c] {
        assert!(pages_mapped(inside(t)).iter().all(|&x| x), "{t} read back");
    }
    m.release(&[b]).unwrap();
    for t in [a, c] {
        assert!(
            !pages_mapped(inside(t)).iter().any(|&x| x),
            "{t}: released, mapped again by a read of {b}'s neighbourhood, unmapped by {b}'s release"
        );
    }
    assert!(
        pages_mapped(inside(kept)).iter().all(|&x| x),
        "{kept}, never released, stays mapped"
    );
    // and everything still reads
    for t in [a, b, c, kept] {
        assert!(!m.tensor(t).unwrap().bytes.is_empty());
    }
}
