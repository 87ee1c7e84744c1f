#include <string.h>
#include <stdlib.h>
#include <stdbool.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include "kvl_helpers.h"

int kvl_getinfo(const char *prov_name, const char *node, const char *service,
                int hmem, struct fi_info **info) {
    struct fi_info *hints = fi_allocinfo();
    if (!hints) return -FI_ENOMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_RMA | FI_READ | FI_REMOTE_READ;
    if (hmem) hints->caps |= FI_HMEM;
    hints->mode = FI_CONTEXT;
#ifdef FI_CONTEXT2
    hints->mode |= FI_CONTEXT2;
#endif
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    if (hmem) hints->domain_attr->mr_mode |= FI_MR_HMEM;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    if (prov_name) hints->fabric_attr->prov_name = strdup(prov_name);
    uint64_t flags = 0;
    if (node && !service) flags |= FI_SOURCE;
    int ret = fi_getinfo(FI_VERSION(1, 17), node, service, node ? FI_SOURCE : 0, hints, info);
    (void)flags;
    fi_freeinfo(hints);
    return ret;
}

int kvl_mr_reg(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
               uint64_t requested_key, int iface, int device, struct fid_mr **mr) {
    struct iovec iov = { .iov_base = buf, .iov_len = len };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = iface == 1 ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (iface == 1) attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, 0, mr);
}

uint64_t kvl_info_mr_mode(const struct fi_info *i) { return (uint64_t)i->domain_attr->mr_mode; }
size_t kvl_info_tx_size(const struct fi_info *i) { return i->tx_attr->size; }
size_t kvl_info_rma_iov_limit(const struct fi_info *i) { return i->tx_attr->rma_iov_limit; }
size_t kvl_info_iov_limit(const struct fi_info *i) { return i->tx_attr->iov_limit; }
size_t kvl_info_max_msg_size(const struct fi_info *i) { return i->ep_attr->max_msg_size; }
uint64_t kvl_info_mode(const struct fi_info *i) { return i->mode; }
const char *kvl_info_prov_name(const struct fi_info *i) { return i->fabric_attr->prov_name; }
const char *kvl_info_fabric_name(const struct fi_info *i) { return i->fabric_attr->name; }
const char *kvl_info_domain_name(const struct fi_info *i) { return i->domain_attr->name; }
uint32_t kvl_info_prov_version(const struct fi_info *i) { return i->fabric_attr->prov_version; }

#if __has_include(<rdma/fi_ext.h>)
#include <rdma/fi_ext.h>
#endif

int kvl_efa_pre_enable(struct fid_ep *ep, int rnr_retry) {
#ifdef FI_OPT_EFA_RNR_RETRY
    if (rnr_retry >= 0) {
        size_t v = (size_t)rnr_retry;
        return fi_setopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_EFA_RNR_RETRY, &v, sizeof(v));
    }
#else
    (void)ep; (void)rnr_retry;
#endif
    return 0;
}

int kvl_efa_emulated_read(struct fid_ep *ep) {
#ifdef FI_OPT_EFA_EMULATED_READ
    bool emulated = false;
    size_t len = sizeof(emulated);
    if (fi_getopt(&ep->fid, FI_OPT_ENDPOINT, FI_OPT_EFA_EMULATED_READ, &emulated, &len) == 0)
        return emulated ? 1 : 0;
#else
    (void)ep;
#endif
    return -1;
}
