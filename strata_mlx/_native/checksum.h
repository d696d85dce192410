/* Checksums of expert records and store files (see checksum.c). */
#ifndef STRATA_CHECKSUM_H
#define STRATA_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

enum { CHECKSUM_NONE = 0, CHECKSUM_CRC32 = 1, CHECKSUM_CRC32C = 2 };

/* Build the tables once, before any other call (module init). */
void checksum_init(void);

/* crc of `n` bytes at `p` continuing from `crc` (0 to start), as zlib.crc32 / crc32c do:
 * checksum(a + b) == checksum_update(kind, checksum(a), b). Thread-safe after init. */
uint32_t checksum_update(int kind, uint32_t crc, const void *p, size_t n);

/* checksum(a + b) from checksum(a), checksum(b) and len(b), as zlib's crc32_combine: a record
 * read in parts by several threads is verified from its parts' checksums. */
uint32_t checksum_combine(int kind, uint32_t crc1, uint32_t crc2, uint64_t len2);

/* The portable tables whatever the CPU has (tests compare the two). */
uint32_t checksum_update_table(int kind, uint32_t crc, const void *p, size_t n);

/* Which implementation `kind` uses on this CPU: "sse4.2", "pclmul", "armv8-crc" or "table". */
const char *checksum_impl(int kind);

#endif
