/* Small C helpers for the parts of libfabric's API whose struct layout moved
 * between 1.x and 2.x (fields that went into anonymous unions): compiled
 * against whatever libfabric is installed, so the Rust side never names them. */
#ifndef KVL_HELPERS_H
#define KVL_HELPERS_H
#include <stdint.h>
#include <stddef.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

/* fi_getinfo for an RDM endpoint with FI_RMA|FI_READ|FI_REMOTE_READ on the
 * named provider (e.g. "tcp;ofi_rxm", "shm", "efa"), asking for every memory
 * registration mode bit kvloop handles. node/service may be NULL. */
int kvl_getinfo(const char *prov_name, const char *node, const char *service,
                int hmem, struct fi_info **info);

/* Register [buf, buf+len) with the given access flags through fi_mr_regattr.
 * iface: 0 = system memory, 1 = CUDA (device = ordinal). */
int kvl_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
               uint64_t requested_key, int iface, int device, struct fid_mr **mr);

/* Accessors for fields read by the Rust side. */
uint64_t kvl_info_mr_mode(const struct fi_info *info);
size_t kvl_info_tx_size(const struct fi_info *info);
size_t kvl_info_rma_iov_limit(const struct fi_info *info);
size_t kvl_info_iov_limit(const struct fi_info *info);
size_t kvl_info_max_msg_size(const struct fi_info *info);
uint64_t kvl_info_mode(const struct fi_info *info);
const char *kvl_info_prov_name(const struct fi_info *info);
const char *kvl_info_fabric_name(const struct fi_info *info);
const char *kvl_info_domain_name(const struct fi_info *info);
uint32_t kvl_info_prov_version(const struct fi_info *info);
#endif

/* EFA endpoint options (libfabric >= 1.18 headers; no-ops elsewhere).
 * Call before fi_enable. rnr_retry < 0 leaves the provider default.
 * Returns 0, or a negative FI_E* code. */
int kvl_efa_pre_enable(struct fid_ep *ep, int rnr_retry);
/* After fi_enable: 1 when the efa provider emulates RMA READ in software
 * (FI_OPT_EFA_EMULATED_READ), 0 when reads are real hardware RDMA, -1 when
 * unknown (not efa, or headers without the option). */
int kvl_efa_emulated_read(struct fid_ep *ep);
